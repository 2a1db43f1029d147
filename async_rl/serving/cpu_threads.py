"""Where a CPU engine's threads run: vLLM reads its OpenMP binding from the environment when its
engine process starts, so these are set before `vllm_compat.make_engine`."""

from __future__ import annotations

import os

from async_rl.cluster.placement import pin_current_process


def omp_bind(cores: list[int], tensor_parallel_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND value: the engine's cores split among its TP workers ('0,1|2,3')."""
    per = max(1, len(cores) // tensor_parallel_size)
    lists = []
    for r in range(tensor_parallel_size):
        last = r == tensor_parallel_size - 1
        chunk = cores[r * per : None if last else (r + 1) * per] or [cores[r % len(cores)]]
        lists.append(",".join(map(str, chunk)))
    return "|".join(lists)


def bind_engine_to(cores: list[int], tensor_parallel_size: int) -> None:
    """Keep the engine this process starts on `cores`; call before `make_engine`. vLLM's OMP binding
    covers only its worker threads; its engine-core (scheduler) process and this process
    (detokenising, rewards, ZMQ) inherit the process affinity. Unpinned, they took ~65% of a core
    from a disaggregated learner."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(cores, tensor_parallel_size)
    pin_current_process(cores)


def leave_engine_unbound(threads: int, tensor_parallel_size: int) -> None:
    """No cores to pin to (a Ray cluster, or an engine beyond the launch plan): vLLM binds no thread
    ('auto' would take a whole NUMA node per worker) and each worker runs its share of `threads`."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OMP_NUM_THREADS"] = str(max(1, threads // tensor_parallel_size))
