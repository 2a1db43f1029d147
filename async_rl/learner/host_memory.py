"""Host memory of a learner rank: one malloc arena (set at process start), and optionally freed
tensors given back to the OS (glibc's mmap threshold).

**One arena.** A learner rank is a Ray actor with several calls in flight (`max_concurrency`: a weight
sync or a liveness probe beside `train_step`), and Ray runs each call on one of its pool's threads.
glibc gives each thread that allocates its own malloc arena (up to 8 per core) and an arena keeps
what its thread freed, so every pool thread that ever ran a step holds that step's peak: a learner
rank of SmolLM2-135M on configs/smollm2_arith.yaml grew from 4 GB to 10 GB in 4 steps and 13 GB in 6
(2026-11-28, ~1.5 GB a step), the machine's memory ran out and Ray killed the rank, whose
replacement started again from the initial weights: the run stopped learning without failing. The
same run with `MALLOC_ARENA_MAX=1` stayed at 6.0 GB from step 2 to step 6. glibc reads the limit only
when the process starts (the first thread's arena sizing is fixed before any actor code runs), so it
is set in the actor's environment (`LEARNER_ENV`, config/spec.py; control/runtime.py), not by `mallopt` here.

torch's CPU allocator takes every tensor from malloc. glibc serves an allocation above its mmap
threshold with its own mmap, unmapped again on free, but the threshold is dynamic: the first time
such a block is freed, glibc raises the threshold to that block's size (up to 32 MB on 64-bit), so from
then on a step's activations, gradients of the chunked head and attention masks come from the heap,
and the heap keeps what they freed, fragmented. Measured on SmolLM2-135M, one step of the arithmetic
batch at micro_batch_tokens 4096 with activation checkpointing (benchmarks/results/learner-quiet.md and
learner-malloc.md, quiet machine): peak RSS 4.6 GB with glibc's default, 3.6 GB with a fixed 4 MB
threshold, 3.2 GB with 128 KB.

`mallopt(M_MMAP_THRESHOLD, n)` fixes the threshold (glibc then stops adjusting it) and
`M_TRIM_THRESHOLD` lets the heap's top be trimmed at the same size. The price: every allocation above
it is an mmap whose pages are faulted in afresh, and a step allocates many gigabytes of short-lived
tensors: the same step took 21.2 s instead of 16.3 s (16.8 vs 13.7 s without checkpointing). So it
is off by default (learner.malloc_mmap_threshold_kb 0), a switch for runs whose limit is memory. Not
glibc (musl, macOS): nothing to set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3

def set_malloc_mmap_threshold(kb: int) -> bool:
    """Fix glibc's mmap and trim thresholds of this process at `kb` KiB (learner.malloc_mmap_threshold_kb).
    0 leaves glibc's dynamic default. True when set; False where the C library is not glibc."""
    if kb <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    size = kb * 1024
    return bool(mallopt(M_MMAP_THRESHOLD, size)) and bool(mallopt(M_TRIM_THRESHOLD, size))
