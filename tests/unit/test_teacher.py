"""The teacher's replica and the engines' scorer over real HTTP (the replica's vLLM replaced by a
scripted model): scores per completion token, environment tokens zeroed, the run's key, failed and
late calls counted and tried again until a restarted replica answers, a group pushed unscored (and
counted) past teacher.max_wait_s; the tokenizer check; the per-step metrics."""

from __future__ import annotations

import asyncio
import math

import msgspec
import numpy as np
import pytest
from transformers import AutoTokenizer

from async_rl.config import ConfigError, TeacherConfig, load_config
from async_rl.control.metrics import console_line
from async_rl.models.tiny import resolve_model_path
from async_rl.protocol import REWARD_OK, TrajectoryGroup
from async_rl.reward_models.setup import replica_engine_spec
from async_rl.teacher.meter import TeacherMeter
from async_rl.teacher.scorer import TeacherScorer
from async_rl.teacher.server import TeacherServer, TeacherSettings
from async_rl.teacher.setup import check_tokenizers
from async_rl.teacher.wire import TeacherCounts
from tests._presets import model_cache
from tests.unit.test_rollout_counts import record

KEY = "k" * 43


def logp(ids: list[int], i: int) -> float:
    """The scripted teacher's log-prob of token i of `ids` (a function of the token and its position)."""
    return -0.125 * (ids[i] % 8) - 0.5 * (i % 3)


class ScriptedModel:
    """Stands in for the replica's ServedModel: vLLM's prompt log-probs, scripted."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.started = False
        self.calls = 0

    async def start(self) -> None:
        self.started = True

    def open(self) -> None:
        pass

    def dead(self) -> bool:
        return False

    def engine_core_pids(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        pass

    async def score_tokens(self, ids: list[int], request_id: str) -> list[float]:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        return [math.nan] + [logp(ids, i) for i in range(1, len(ids))]


def replica(monkeypatch, replica_id: int = 0, key: str = KEY, delay_s: float = 0.0) -> TeacherServer:
    for var in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):  # the replica sets them for its vLLM
        monkeypatch.setenv(var, "1")
    spec = replica_engine_spec(TeacherConfig(device="cpu"), "/nowhere", 64, replica_id)
    server = TeacherServer(TeacherSettings(replica_id=replica_id, spec=spec, model_name="t", key=key, threads=1, hang_s=0.0))
    server.model = ScriptedModel(delay_s)
    return server


def group() -> TrajectoryGroup:
    """A plain sample, a multi-turn one (its second token the environment's) and an empty completion."""
    return TrajectoryGroup(
        prompt_id=3, engine_id=0, prompt_tokens=np.array([4, 9], np.int32),
        completions=[np.array([5, 6, 7], np.int32), np.array([1, 2, 3], np.int32), np.array([], np.int32)],
        logprobs=[np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(0, np.float32)],
        rewards=[0.0] * 3, version_first=[0] * 3, version_last=[0] * 3, reward_status=[REWARD_OK] * 3,
        loss_masks=[None, np.array([1, 0, 1], np.uint8), None],
    )


def want(g: TrajectoryGroup) -> list[list[float]]:
    out = []
    for i, c in enumerate(g.completions):
        ids = [*g.prompt_tokens.tolist(), *c.tolist()]
        values = [logp(ids, len(g.prompt_tokens) + j) for j in range(len(c))]
        out.append([v if m else 0.0 for v, m in zip(values, g.loss_mask(i), strict=True)])
    return out


def flat(rows) -> list[float]:
    return [x for row in rows for x in row]


def run(coro):
    return asyncio.run(coro)


def test_a_group_is_scored_per_completion_token_with_environment_tokens_zeroed(monkeypatch):
    async def go():
        server = replica(monkeypatch)
        endpoint = await server.start()
        scorer = TeacherScorer([endpoint], timeout_s=5, max_wait_s=5)
        try:
            g = await scorer.score(group(), rollout_s=3.0)
        finally:
            await scorer.close()
            await server.shutdown()
        return g, scorer.counts, server.stats()

    g, counts, stats = run(go())
    got = [t.tolist() for t in g.teacher_logprobs]
    assert flat(got) == pytest.approx(flat(want(group())))  # float32 on the wire
    assert got[1][1] == 0.0  # the environment's token
    assert (counts.groups, counts.samples, counts.tokens, counts.unscored, counts.failures) == (1, 3, 6, 0, 0)
    assert counts.rollout_s == 3.0 and counts.score_s > 0
    assert stats.requests == 1 and stats.refused == 0


def test_a_wrong_key_is_refused_and_the_group_goes_unscored_after_max_wait(monkeypatch):
    async def go():
        server = replica(monkeypatch, key="other" * 9)
        endpoint = await server.start()
        # the engine holds the run's key; this replica was started with another one
        scorer = TeacherScorer([msgspec.structs.replace(endpoint, key=KEY)], timeout_s=5, max_wait_s=0.5)
        try:
            g = await scorer.score(group())
        finally:
            await scorer.close()
            await server.shutdown()
        return g, scorer, server.stats()

    g, scorer, stats = run(go())
    assert g.teacher_logprobs is None  # pushed without: counted, not dropped
    assert scorer.counts.unscored == 3 and scorer.counts.failures >= 1 and scorer.counts.groups == 0
    assert "HTTP 401" in scorer.last_error
    assert stats.refused >= 1 and stats.requests == 0


def test_a_group_waits_out_a_dead_replica_and_is_scored_by_its_restart(monkeypatch):
    """The replica the group was sent to is gone (connection refused); the supervisor's restart hands
    the engine a new address while the group waits: the group is scored there, nothing unscored."""

    async def go():
        dead = replica(monkeypatch, replica_id=0)
        old = await dead.start()
        await dead.shutdown()  # its port now refuses connections
        scorer = TeacherScorer([old], timeout_s=5, max_wait_s=30)
        task = asyncio.create_task(scorer.score(group()))

        async def first_failure():
            while scorer.counts.failures == 0:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(first_failure(), 10)
        assert not task.done()
        new_replica = replica(monkeypatch, replica_id=0)
        scorer.endpoints = [await new_replica.start()]  # what set_teacher_endpoints does
        try:
            g = await asyncio.wait_for(task, 10)
        finally:
            await scorer.close()
            await new_replica.shutdown()
        return g, scorer.counts

    g, counts = run(go())
    assert flat(t.tolist() for t in g.teacher_logprobs) == pytest.approx(flat(want(group())))
    assert counts.unscored == 0 and counts.failures >= 1 and counts.groups == 1


def test_a_late_teacher_is_a_counted_timeout_and_tried_again(monkeypatch):
    async def go():
        server = replica(monkeypatch, delay_s=0.6)
        endpoint = await server.start()
        scorer = TeacherScorer([endpoint], timeout_s=0.2, max_wait_s=1.5)
        try:
            g = await scorer.score(group())
        finally:
            await scorer.close()
            await server.shutdown()
        return g, scorer.counts

    g, counts = run(go())
    assert g.teacher_logprobs is None
    assert counts.timeouts >= 2 and counts.unscored == 3  # tried again after the first timeout


def test_no_replica_at_all_is_a_counted_failure(monkeypatch):
    scorer = TeacherScorer([], timeout_s=1, max_wait_s=0.1)
    g = run(scorer.score(group()))
    assert g.teacher_logprobs is None and scorer.counts.unscored == 3
    assert scorer.last_error == "no teacher replica is running"


def test_bad_request_bodies_are_refused_in_one_line(monkeypatch):
    import httpx

    async def go():
        server = replica(monkeypatch)
        endpoint = await server.start()
        try:
            async with httpx.AsyncClient() as client:
                headers = {"Authorization": f"Bearer {KEY}"}
                garbage = await client.post(endpoint.base_url + "/score", content=b"\xc1", headers=headers)
                body = msgspec.msgpack.encode({"prompt": b"\x01\x00\x00", "completions": []})
                odd = await client.post(endpoint.base_url + "/score", headers=headers, content=body)
        finally:
            await server.shutdown()
        return garbage, odd

    garbage, odd = run(go())
    assert garbage.status_code == 400 and "bad request body" in garbage.json()["error"]["message"]
    assert odd.status_code == 400 and "whole number of int32" in odd.json()["error"]["message"]


# ---------------------------------------------------------------- tokenizer check


def test_the_same_tokenizer_passes_and_another_is_refused_in_one_line(tmp_path):
    tiny = resolve_model_path("tiny-qwen2", model_cache())
    wide = resolve_model_path("tiny-qwen2-wide", model_cache())
    check_tokenizers(tiny, wide)  # one character-level tokenizer, two model sizes
    other = AutoTokenizer.from_pretrained(str(tiny))
    other.add_tokens(["<extra>"])
    other.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as exc:
        check_tokenizers(tiny, tmp_path)
    line = str(exc.value)
    assert "\n" not in line and "'<extra>'" in line and "another tokenizer than the student" in line


def test_teacher_config_errors_are_one_line():
    with pytest.raises(ConfigError, match="does not use it"):
        load_config(None, ["teacher.model=tiny-qwen2"])
    with pytest.raises(ConfigError, match="neither a preset"):
        load_config(None, ["algorithm.name=opd", "teacher.model=/no/such/folder"])
    cfg = load_config(None, ["algorithm.name=opd", "teacher.model=tiny-qwen2-wide"])
    assert cfg.teacher.model == "tiny-qwen2-wide"


# ---------------------------------------------------------------- metrics


def test_meter_takes_per_step_differences():
    meter = TeacherMeter()
    a = TeacherCounts(groups=2, samples=8, tokens=400, score_s=1.0, rollout_s=3.0)
    b = TeacherCounts(groups=1, samples=4, tokens=100, unscored=4, failures=2, score_s=1.0, rollout_s=1.0)
    first = meter.step({0: a, 1: b}, step_s=10.0)
    assert (first.tokens, first.tokens_per_s, first.share) == (500, 50.0, 2.0 / 6.0)
    assert (first.unscored, first.failures) == (4, 2)
    a2 = TeacherCounts(groups=3, samples=12, tokens=600, score_s=2.0, rollout_s=6.0)
    second = meter.step({0: a2, 1: b}, step_s=4.0)
    assert (second.tokens, second.tokens_per_s, second.share) == (200, 50.0, 0.25)
    # engine 1 was replaced by engine 2 (its counters start at 0): what engine 1 counted stays counted
    c = TeacherCounts(groups=1, samples=4, tokens=50, unscored=2, score_s=1.0, rollout_s=1.0)
    third = meter.step({0: a2, 2: c}, step_s=1.0)
    assert (third.tokens, third.unscored, third.failures) == (50, 6, 2)


def test_console_line_shows_the_teacher():
    r = record()
    r.kl_teacher, r.teacher_tokens, r.teacher_tokens_per_s, r.teacher_share = 0.25, 300, 150.0, 0.2
    assert "teacher KL 0.250 150 tok/s share 20%" in console_line(r, 10)


def test_the_launch_refuses_a_teacher_with_another_tokenizer_before_anything_starts(tmp_path, capsys):
    """One line on stderr, exit 2, no run directory, no Ray."""
    import shutil

    from async_rl import launch

    teacher = tmp_path / "teacher"
    shutil.copytree(resolve_model_path("tiny-qwen2-wide", model_cache()), teacher)
    tok = AutoTokenizer.from_pretrained(str(teacher))
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(teacher)
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  cache_dir: {model_cache()}\nalgorithm:\n  name: opd\nteacher:\n  model: {teacher}\n"
                      f"logging:\n  run_dir: {tmp_path / 'runs'}\n")
    assert launch.main([str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: teacher.model") and "'<extra>'" in err
    assert not (tmp_path / "runs").exists()


def test_the_plan_places_the_teachers_replicas_beside_the_pool():
    from async_rl.cluster.placement import plan_placement

    cfg = load_config(None, ["algorithm.name=opd", "teacher.model=tiny-qwen2-wide", "teacher.replicas=2"])
    text = plan_placement(cfg, cores=[0, 1]).render()
    assert "teacher: 2 replica(s) of 1 CPU(s)" in text
