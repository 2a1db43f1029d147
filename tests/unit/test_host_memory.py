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


# In a fresh process: four live threads in turn (as Ray's pool runs a learner rank's calls) each hold 40
# tensors of 4 MB at once and free all but the last (which pins its heap's top). Each thread that
# allocates gets its own glibc arena unless MALLOC_ARENA_MAX caps them; an arena keeps what it freed.
THREADS_PROBE = """
import threading, torch
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
n = 2**20  # float32 elements: 4 MB
first = torch.ones(n)
del first  # glibc's dynamic mmap threshold rises to 4 MB: later blocks come from the arenas
before = rss_mb()
kept = []
def step():
    held = [torch.ones(n) for _ in range(40)]
    kept.append(held.pop())
    del held
# The threads stay alive, each waiting for its turn (an exited thread's arena would pass to the next).
turns, done = [threading.Event() for _ in range(4)], threading.Event()
def worker(i):
    turns[i].wait()
    step()
    if i + 1 < len(turns):
        turns[i + 1].set()
    else:
        done.set()
    done.wait()
threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
turns[0].set()
done.wait()
print(round(rss_mb() - before))
for t in threads:
    t.join()
"""


def resident_after_threads(env: dict[str, str]) -> int:
    import os

    base = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", THREADS_PROBE], capture_output=True, text=True, check=True,
                         env={**base, **env})
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas")
def test_the_learner_env_keeps_one_arena_for_the_ranks_threads():
    from async_rl.config.spec import LEARNER_ENV
    from async_rl.control.runtime import learner_actor_options

    per_thread_arenas = resident_after_threads({})
    one_arena = resident_after_threads(LEARNER_ENV)
    # Without the cap each thread's arena keeps its 160 MB peak (measured 640 MB over four threads); with it
    # the threads reuse one heap (250-300 MB: one peak and the kept tensors' fragments).
    assert per_thread_arenas > 480, per_thread_arenas
    assert one_arena < 0.6 * per_thread_arenas, (one_arena, per_thread_arenas)
    options = learner_actor_options({"num_cpus": 1})
    assert options["runtime_env"]["env_vars"]["MALLOC_ARENA_MAX"] == LEARNER_ENV["MALLOC_ARENA_MAX"]
    assert options["num_cpus"] == 1 and options["max_concurrency"] > 1
