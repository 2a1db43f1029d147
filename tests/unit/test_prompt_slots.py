"""A group waiting for its teacher scores gives its generating slot back: a slow or restarting teacher
does not stop the engine's generation, up to `teacher.max_waiting_groups` finished groups held at once
(scoring never blocks the engines)."""

from __future__ import annotations

import asyncio

from async_rl.config import TaskConfig, TeacherConfig
from async_rl.generator.engine import EngineSettings, GeneratorEngine
from async_rl.generator.slots import PromptSlots
from async_rl.protocol import Prompt
from async_rl.serving import vllm_compat as vc


def test_a_waiting_group_frees_its_generating_slot_up_to_the_bound():
    async def scenario() -> None:
        slots = PromptSlots(max_generating=2, max_waiting=3)
        for rid in ("a", "b"):
            slots.start(rid)
        assert slots.room() == 0
        slots.rolled_out("a")
        assert (slots.generating, slots.waiting, slots.room()) == (1, 1, 1)
        for rid in ("c", "d", "e"):
            slots.start(rid)
            slots.rolled_out(rid)
        assert (slots.generating, slots.waiting, slots.room()) == (1, 4, 0)  # 5 held: the bound
        slots.finished("c")  # scored and pushed
        assert slots.room() == 1
        slots.finished("b")  # a generating request lost
        assert (slots.generating, slots.waiting, slots.room()) == (0, 3, 2)

    asyncio.run(scenario())


def test_without_waiting_room_a_waiting_group_keeps_its_slot():
    slots = PromptSlots(max_generating=2, max_waiting=0)
    slots.start("a")
    slots.rolled_out("a")
    assert (slots.generating, slots.waiting, slots.room()) == (0, 1, 1)
    slots.finished("a")
    assert slots.room() == 2


def test_wait_for_room_wakes_when_a_group_is_done():
    async def scenario() -> None:
        slots = PromptSlots(max_generating=1)
        slots.start("a")
        waiter = asyncio.create_task(slots.wait_for_room())
        await asyncio.sleep(0)
        assert not waiter.done()
        slots.finished("a")
        await asyncio.wait_for(waiter, 1.0)

    asyncio.run(scenario())


class _Lease:
    def __init__(self, leased: list[int]) -> None:
        self.leased = leased

    async def remote(self, engine_id: int, n: int, timeout_s: float) -> list[Prompt]:
        start = len(self.leased)
        self.leased.extend(range(start, start + n))
        return [Prompt(prompt_id=i) for i in range(start, start + n)]


class _Buffer:
    def __init__(self) -> None:
        self.leased: list[int] = []
        self.lease = _Lease(self.leased)


class _Rollout:
    async def group(self, prompt: Prompt, request_id: str, sampling, n: int) -> Prompt:
        return prompt  # generated at once: the group stands for itself


class _Teacher:
    """A teacher that answers only when the test lets a group through."""

    def __init__(self) -> None:
        self.release = asyncio.Queue()

    async def score(self, group, rollout_s: float = 0.0):
        await self.release.get()
        return group


def engine(max_waiting_groups: int) -> tuple[GeneratorEngine, _Buffer, list]:
    spec = vc.EngineSpec(model_dir="unused", dtype="float32", tensor_parallel_size=1, max_model_len=64,
                         gpu_memory_utilization=0.5, seed=0, max_num_seqs=1)
    teacher = TeacherConfig(model="a-teacher", max_waiting_groups=max_waiting_groups)
    s = EngineSettings(engine_id=0, run_id="r", spec=spec, cores=[], group_size=1, max_tokens=4, temperature=1.0,
                       max_inflight_prompts=2, pause_mode="keep", task=TaskConfig(), reward_timeout_s=1.0,
                       reward_workers=1, ingest_address="", teacher=teacher)
    buffer = _Buffer()
    eng = GeneratorEngine(s, buffer)
    eng.rollout, eng.teacher, eng.sampling = _Rollout(), _Teacher(), None
    pushed: list = []

    async def push(group) -> None:
        pushed.append(group.prompt_id)

    eng._push_group = push
    eng.model.open()
    return eng, buffer, pushed


async def _settle() -> None:
    for _ in range(50):  # every ready task runs: no clock involved
        await asyncio.sleep(0)


def test_an_engine_keeps_leasing_while_the_teacher_holds_its_groups():
    async def scenario(max_waiting_groups: int) -> tuple[int, int, list]:
        eng, buffer, pushed = engine(max_waiting_groups)
        loop = asyncio.create_task(eng._generate_loop())
        await _settle()
        held = len(buffer.leased)
        eng.teacher.release.put_nowait(None)  # the teacher answers one group
        await _settle()
        after = len(buffer.leased)
        eng._stop = True
        loop.cancel()
        for t in list(eng._inflight.values()):
            t.cancel()
        await asyncio.gather(loop, *eng._inflight.values(), return_exceptions=True)
        return held, after, pushed

    # with room for 3 waiting groups the engine holds 2 + 3 prompts, then leases one per scored group
    assert asyncio.run(scenario(3)) == (5, 6, [0])
    # a waiting group that kept its slot (the old behaviour) stops generation at 2
    assert asyncio.run(scenario(0)) == (2, 3, [0])
