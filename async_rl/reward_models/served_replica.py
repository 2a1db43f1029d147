"""A replica served beside the pool that owns a vLLM engine of its own (a `ServedModel`): the LLM
judge (judge_engine.py) and the distillation teacher (teacher/server.py). What they share: health is
the engine core's, the pending watch returns when it dies, the processes are the actor's and vLLM's."""

from __future__ import annotations

import asyncio
import os

from async_rl.reward_models.server import ReplicaPids, RewardModelServer
from async_rl.serving import cpu_threads
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel


class ServedModelReplica(RewardModelServer):
    def __init__(self, spec: vc.EngineSpec, threads: int) -> None:
        # vLLM reads the thread settings when its engine process starts: set them before it does.
        cpu_threads.leave_engine_unbound(threads, spec.tensor_parallel_size)
        self.model = ServedModel(spec)

    async def start_model(self) -> None:
        """Start the engine and serve at once: a replica is never paused (no weight update reaches it)."""
        await self.model.start()
        self.model.open()

    def healthy(self) -> bool:
        return self.model.started and not self.model.dead()

    async def watch(self) -> str:
        """Returns once vLLM's engine core died (the actor's own death fails the call instead)."""
        while not self.model.started or self.healthy():
            await asyncio.sleep(vc.DEATH_POLL_S)
        return "vLLM's engine core died"

    def pids(self) -> ReplicaPids:
        return ReplicaPids(actor=os.getpid(), engine_core=self.model.engine_core_pids())
