"""The buffer's ZMQ ingest with real sockets: rejected frames release their leases, duplicates and
removals never crash the loop, and the accounting stays exact."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import zmq
import zmq.asyncio

from async_rl.buffer.actor import BufferSettings, ReplayBuffer
from async_rl.learner.batch_client import BatchClient
from async_rl.protocol import TrajectoryGroup, encode_groups

pytestmark = pytest.mark.integration

GROUP = 2


def group(prompt_id: int, engine_id: int = 0, logprob: float = -0.5) -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt_id=prompt_id,
        engine_id=engine_id,
        prompt_tokens=np.array([5, 6], dtype=np.int32),
        completions=[np.array([7, 8], dtype=np.int32)] * GROUP,
        logprobs=[np.array([logprob, -0.1], dtype=np.float32)] * GROUP,
        rewards=[0.0, 1.0],
        version_first=[0] * GROUP,
        version_last=[0] * GROUP,
        reward_status=[0] * GROUP,
    )


def local_buffer(prompts_per_step: int, max_lag: int = 1, filter_uniform_groups: bool = False) -> ReplayBuffer:
    """A buffer on loopback with ephemeral ports, run 'r', the 'repeat' task."""
    return ReplayBuffer(
        BufferSettings(
            run_id="r", host="127.0.0.1", ingest_port=0, serve_port=0, max_lag=max_lag,
            prompts_per_step=prompts_per_step, group_size=GROUP, filter_uniform_groups=filter_uniform_groups,
            max_frame_bytes=1 << 20, task_name="repeat", task_seed=0,
        )
    )


async def scenario() -> None:
    buffer = local_buffer(prompts_per_step=4)
    addresses = await buffer.start()
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(addresses.ingest)
    try:
        prompts = await buffer.lease(engine_id=0, max_groups=3)
        a, b, c = (p.prompt_id for p in prompts)

        async def send_and_settle(frames, want):
            await push.send_multipart(frames)
            for _ in range(200):  # bounded: the ingest task needs a few loop turns
                stats = buffer.stats()
                if want(stats):
                    return stats
                await asyncio.sleep(0.01)
            raise AssertionError(f"buffer never reached the expected state: {buffer.stats()}")

        # A frame with a positive log-prob is rejected, and its lease is released as lost.
        s = await send_and_settle(encode_groups("r", [group(a, logprob=0.5)]), lambda s: s.accounts.lost == GROUP)
        assert s.rejected_frames == {"bad_value": 1} and s.accounts.balanced()
        # The same prompt twice in one frame: rejected, and the ingest loop lives on.
        s = await send_and_settle(
            encode_groups("r", [group(b), group(b)]), lambda s: s.rejected_frames.get("duplicate_prompt") == 1
        )
        # b was released by the duplicate frame; c still arrives normally afterwards.
        s = await send_and_settle(encode_groups("r", [group(c)]), lambda s: s.accounts.waiting == GROUP)
        assert s.accounts.lost == 2 * GROUP and s.accounts.in_flight == 0 and s.accounts.balanced()
        # A late frame for a prompt already accounted for is counted, not accepted twice.
        s = await send_and_settle(encode_groups("r", [group(c)]), lambda s: s.rejected_frames.get("unknown_prompt") == 1)
        assert s.accounts.waiting == GROUP and s.accounts.balanced()
        # Removing the engine counts whatever it still held lost, exactly once.
        more = await buffer.lease(engine_id=0, max_groups=1)
        assert await buffer.mark_lost(0) == len(more) == 1
        assert await buffer.mark_lost(0) == 0
        assert buffer.stats().accounts.balanced()
    finally:
        ctx.destroy(linger=0)
        await buffer.close()


def test_rejections_release_leases_and_accounting_stays_exact():
    asyncio.run(scenario())


async def dynamic_sampling_scenario() -> None:
    buffer = local_buffer(prompts_per_step=2, filter_uniform_groups=True)
    addresses = await buffer.start()
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(addresses.ingest)
    try:
        prompts = await buffer.lease(engine_id=0, max_groups=4)
        assert len(prompts) == 4  # (max_lag + 1) * 2 groups
        uniform = [group(p.prompt_id) for p in prompts[:3]]
        for g in uniform:
            g.rewards = [0.25, 0.25]
        await push.send_multipart(encode_groups("r", [*uniform, group(prompts[3].prompt_id)]))
        for _ in range(200):
            if buffer.stats().accounts.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        s = buffer.stats()
        # Uniform groups carry no signal: filtered, counted, and their admission capacity is free again.
        assert s.accounts.filtered == 3 * GROUP and s.accounts.waiting == GROUP and s.accounts.balanced()
        more = await buffer.lease(engine_id=0, max_groups=4)
        assert len(more) == 3
        await push.send_multipart(encode_groups("r", [group(more[0].prompt_id)]))
        client = BatchClient(addresses.serve, "r", rank=0, world_size=1, curve=None)
        try:
            batch = await asyncio.to_thread(client.fetch, 0, 10.0)  # a learner rank asks for step 0
        finally:
            client.close()
        assert [g.prompt_id for g in batch] == [prompts[3].prompt_id, more[0].prompt_id]
        assert all(len(set(g.rewards)) > 1 for g in batch)
        assert buffer.stats().last_batch_filtered_groups == 3
    finally:
        ctx.destroy(linger=0)
        await buffer.close()


async def burst_scenario() -> None:
    """Frames queued faster than the loop runs are drained in batches: each one is still decoded,
    checked and counted on its own, a bad frame in the middle of a batch rejects only itself."""
    n = 600  # more than one drain batch (INGEST_BATCH_FRAMES)
    buffer = local_buffer(prompts_per_step=n, max_lag=0)
    addresses = await buffer.start()
    ctx = zmq.Context()  # a blocking socket: queue every frame before the ingest loop gets a turn
    push = ctx.socket(zmq.PUSH)
    push.connect(addresses.ingest)
    try:
        ids = [p.prompt_id for p in await buffer.lease(engine_id=0, max_groups=n)]
        assert len(ids) == n
        bad = set(ids[5::50])  # positive log-probs: rejected one by one
        for pid in ids:
            push.send_multipart(encode_groups("r", [group(pid, logprob=0.5 if pid in bad else -0.5)]))
        push.send_multipart(encode_groups("r", [group(ids[0])]))  # a late duplicate of an accepted prompt
        # Other tasks on the buffer's loop (control calls, batch serving) get turns while a backlog
        # drains: this one polls at every turn it gets and must see the backlog part-way done.
        seen: list[int] = []
        for _ in range(100_000):
            s = buffer.stats()
            seen.append(s.waiting_groups)
            if s.accounts.in_flight == 0 and sum(s.rejected_frames.values()) == len(bad) + 1:
                break
            await asyncio.sleep(0 if len(seen) < 50_000 else 0.01)
        assert any(0 < w < n - len(bad) for w in seen), "the ingest loop never yielded while draining"
        s = buffer.stats()
        assert s.rejected_frames == {"bad_value": len(bad), "unknown_prompt": 1}
        assert s.accounts.waiting == (n - len(bad)) * GROUP and s.accounts.lost == len(bad) * GROUP
        assert s.accounts.balanced() and s.waiting_groups == n - len(bad)
    finally:
        ctx.destroy(linger=0)
        await buffer.close()


def test_dynamic_sampling_filters_uniform_groups_and_keeps_filling_the_batch():
    asyncio.run(dynamic_sampling_scenario())


def test_burst_of_frames_is_drained_in_batches_and_counted_one_by_one():
    asyncio.run(burst_scenario())
