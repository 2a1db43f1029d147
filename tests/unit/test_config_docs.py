"""docs/config.md is generated from the config tree by scripts/gen_config_docs.py: these tests fail
as soon as a config field is added, removed or redescribed without regenerating it (`make docs`)."""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MD = ROOT / "docs" / "config.md"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_what_the_generator_writes() -> None:
    expected = _generator().render()
    actual = CONFIG_MD.read_text()
    if actual != expected:
        diff = "".join(
            list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True), "docs/config.md", "generated"))[:40]
        )
        raise AssertionError(f"docs/config.md is out of date with the config tree: run `make docs`\n{diff}")


def test_reference_lists_exactly_the_keys_describe_prints(capsys) -> None:
    from async_rl import launch

    assert launch.main(["--describe"]) == 0
    printed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    documented = re.findall(r"^\| `([^`]+)` \|", CONFIG_MD.read_text(), re.M)
    assert printed, "--describe printed nothing"
    assert documented == printed


def test_table_cells_survive_markdown() -> None:
    gen = _generator()
    # a pipe would end the cell, '<' start an HTML tag, '*' emphasis
    assert gen._cell("a | b <x> *c*") == "a \\| b &lt;x> \\*c\\*"
    assert gen._code("'a|b'") == "`'a\\|b'`"
