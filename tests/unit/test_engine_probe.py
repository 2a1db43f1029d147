"""The engine's probe scoring: vLLM's log-probs at the probe's positions (`logprobs`, which the LoRA
test compares between two engines) and their mean gap to the learner's (`score`, the mismatch
metric), against a stub of vLLM's prompt scoring (no vLLM started)."""

from __future__ import annotations

import asyncio
import math
import types

import pytest

from async_rl.generator.engine import GeneratorEngine
from async_rl.learner.base import Probe
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel


@pytest.fixture
def engine(monkeypatch) -> GeneratorEngine:
    """An engine whose vLLM scores token t at position i as -(t + i / 10); requests are recorded."""
    requests: list[str] = []

    async def score_tokens(llm, token_ids: list[int], request_id: str, images=None, prompt_len: int = 0) -> list[float]:
        requests.append(request_id)
        return [math.nan] + [-(t + i / 10) for i, t in enumerate(token_ids) if i > 0]

    async def watched(llm, call, what: str):
        return await call

    monkeypatch.setattr(vc, "score_tokens", score_tokens)
    monkeypatch.setattr(vc, "watched", watched)
    e = GeneratorEngine.__new__(GeneratorEngine)
    e.s = types.SimpleNamespace(engine_id=3)
    spec = vc.EngineSpec(model_dir="unused", dtype="float32", tensor_parallel_size=1, max_model_len=64,
                         gpu_memory_utilization=0.5, seed=0, max_num_seqs=1)
    e.model = ServedModel(spec, llm=object())
    e.model.version = 7
    e.requests = requests
    return e


PROBE = Probe(token_ids=[[5, 6, 7], [1, 2, 3, 4]], positions=[[1, 2], [3]], logprobs=[[-6.0, -7.0], [-4.0]])


def test_logprobs_are_vllms_at_the_probes_positions(engine):
    got = asyncio.run(engine.logprobs(PROBE))
    assert got == [[-6.1, -7.2], [-4.3]]
    assert engine.requests == ["e3-probe-v7-0", "e3-probe-v7-1"]


def test_score_is_the_mean_gap_to_the_learners_logprobs(engine):
    got = asyncio.run(engine.score(PROBE))
    assert got == pytest.approx((0.1 + 0.2 + 0.3) / 3)


def test_a_probe_whose_logprobs_do_not_match_its_positions_is_refused(engine):
    with pytest.raises(ValueError):
        asyncio.run(engine.score(Probe(PROBE.token_ids, PROBE.positions, [[-6.0], [-4.0]])))
