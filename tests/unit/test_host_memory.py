"""learner.malloc_mmap_threshold_kb: freed tensors go back to the OS instead of staying in the heap."""

from __future__ import annotations

import subprocess
import sys

import pytest

from async_rl.learner.host_memory import set_malloc_mmap_threshold

# In a fresh process: one 16 MB tensor freed (glibc's dynamic threshold then rises to 16 MB), then 20
# more with the last kept alive (the heap's top stays in use, so trimming cannot give the rest back),
# then the resident memory after freeing the other 19.
PROBE = """
import sys, torch
from async_rl.learner.host_memory import set_malloc_mmap_threshold
set = set_malloc_mmap_threshold(int(sys.argv[1]))
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
n = 4 * 2**20  # float32 elements: 16 MB
first = torch.ones(n)
del first
before = rss_mb()
held = [torch.ones(n) for _ in range(20)]
last = held.pop()
del held
print(set, round(rss_mb() - before))
"""


def resident_after_free(kb: int) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(kb)], capture_output=True, text=True, check=True)
    applied, growth = out.stdout.split()
    return applied == "True", int(growth)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_fixed_threshold_gives_freed_tensors_back():
    default_applied, default_growth = resident_after_free(0)
    fixed_applied, fixed_growth = resident_after_free(128)
    assert not default_applied and fixed_applied
    assert default_growth >= 19 * 16 * 0.9  # glibc's default keeps the 19 freed tensors resident
    assert fixed_growth <= 16 * 1.5  # only the live one (16 MB) stays
    assert set_malloc_mmap_threshold(0) is False  # 0 leaves glibc's default
