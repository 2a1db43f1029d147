"""A replica served beside the pool that owns a vLLM engine of its own (a `ServedModel`): the LLM
judge (judge_engine.py) and the distillation teacher (teacher/server.py). What they share: health is
the engine core's, the pending watch returns when it dies or hangs, the processes are the actor's and
vLLM's.

A hung core (stopped, or stuck) is not dead: its process lives, and its callers only see their calls
time out and try again. So the replica watches progress too: once vLLM has held requests for `hang_s`
without answering any (`ServedModel.stalled_s`), the replica SIGKILLs its core (a hung one would not
answer a shutdown) and reports it; the supervisor then restarts it like a dead one. A stalled actor
(its event loop blocked) is the liveness probe's to find (`generators.unresponsive_s`)."""

from __future__ import annotations

import asyncio
import os

from async_rl.reward_models.server import ReplicaPids, RewardModelServer
from async_rl.serving import cpu_threads
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel


class ServedModelReplica(RewardModelServer):
    def __init__(self, spec: vc.EngineSpec, threads: int, hang_s: float = 0.0) -> None:
        """`hang_s`: vLLM holding requests this long without answering any is a hang (0: never)."""
        # vLLM reads the thread settings when its engine process starts: set them before it does.
        cpu_threads.leave_engine_unbound(threads, spec.tensor_parallel_size)
        self.model = ServedModel(spec)
        self.hang_s = hang_s
        self._hung = ""  # why the core was killed as hung ('' = it was not)

    async def start_model(self) -> None:
        """Start the engine and serve at once: a replica is never paused (no weight update reaches it)."""
        await self.model.start()
        self.model.open()

    def healthy(self) -> bool:
        return self.model.started and not self.model.dead() and not self._hung

    async def watch(self) -> str:
        """Returns once vLLM's engine core died, or hung and was killed (the actor's own death fails
        the call instead)."""
        while not self.model.started or self.healthy():
            stalled = self.model.stalled_s()
            if self.hang_s > 0 and stalled > self.hang_s:
                pids = self.model.kill_engine_core()
                self._hung = f"vLLM's engine core answered no request for {stalled:.0f}s (hung); killed pids {pids}"
                break
            await asyncio.sleep(vc.DEATH_POLL_S)
        return self._hung or self.model.death_line()

    def pids(self) -> ReplicaPids:
        return ReplicaPids(actor=os.getpid(), engine_core=self.model.engine_core_pids())
