"""The test tree has no __init__.py files, so pytest imports every test module by its basename: two
test files with the same name in different tiers stop the whole run at collection ("import file
mismatch"). Keep basenames unique."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], sorted(
        str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if names[p.name] > 1
    )
