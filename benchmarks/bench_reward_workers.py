"""What reward worker processes cost: a pool's cold start, the replacement of a killed worker, and
the per-call overhead, for each start method.

    PYTHONPATH=$PWD python benchmarks/bench_reward_workers.py --method forkserver|spawn [--calls 200]

cold start: pool created -> first reward returned (the fork server starts and imports the reward's
libraries once; spawn imports them in every worker). replacement: a call times out, its worker is
killed -> the next call's result (the new worker's start is all of it). per call: mean over
sequential calls on a warm pool (pickling the Sample both ways, the pipe, the reward itself).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import math_verify  # noqa: F401  imported at the top, as a user's reward module would: the fork server preloads it

from async_rl.config import TaskConfig
from async_rl.generator import rewards
from async_rl.protocol import REWARD_OK, REWARD_TIMEOUT, Prompt, Sample
from async_rl.tasks.rewards import math_reward

HANG = Sample(prompt=Prompt(prompt_id=0, answer="1"), completion="hang")


def reward(sample: Sample) -> float:
    """The 'math' reward, except that the completion 'hang' hangs."""
    if sample.completion == "hang":
        threading.Event().wait(60)
    return math_reward(sample)


def measure(method: str, calls: int) -> dict[str, float]:
    rewards.START_METHOD = method
    sample = Sample(prompt=Prompt(prompt_id=0, answer="1/2"), completion="so the answer is \\boxed{0.5}")
    t0 = time.perf_counter()
    cfg = TaskConfig(reward="benchmarks.bench_reward_workers:reward")  # the workers import this module by name
    runner = rewards.RewardRunner(cfg, timeout_s=0.5, workers=1)

    async def run() -> dict[str, float]:
        assert await runner.score(sample) == (1.0, REWARD_OK)
        cold = time.perf_counter() - t0
        t = time.perf_counter()
        for _ in range(calls):
            await runner.score(sample)
        per_call = (time.perf_counter() - t) / calls
        # A reward past its timeout: its worker is killed; the next call waits for the new worker.
        assert await runner.score(HANG) == (0.0, REWARD_TIMEOUT)
        t = time.perf_counter()
        assert await runner.score(sample) == (1.0, REWARD_OK)
        return {"cold_start_s": cold, "per_call_ms": per_call * 1e3, "replacement_s": time.perf_counter() - t}

    try:
        out = asyncio.run(run())
        return out
    finally:
        runner.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--method", choices=["forkserver", "spawn"], required=True, help="one per process: the fork server is per process")
    args = ap.parse_args()
    print(json.dumps({"method": args.method, **measure(args.method, args.calls)}))


if __name__ == "__main__":
    main()
