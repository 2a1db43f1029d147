"""Finish reasons on the wire, overlong handling (keep / mask / DAPO penalty), completion length
metrics, the model's stop tokens, and the sampling config rules."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch

from async_rl.config import AlgorithmConfig, load_config
from async_rl.control.controller import length_stats
from async_rl.control.metrics import console_line
from async_rl.errors import ConfigError
from async_rl.learner.base import StepMetrics, completion_lengths, truncated_count
from async_rl.learner.batch.packing import SeqSample, packed, padded
from async_rl.learner.batch.padded import PaddedShard
from async_rl.learner.rl.advantages import grpo_advantages, overlong_penalty
from async_rl.learner.rl.algorithms import Algorithm
from async_rl.protocol import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_REASONS,
    FINISH_STOP,
    FrameError,
    GroupsHeader,
    TrajectoryGroup,
    decode_groups,
    encode_groups,
)
from async_rl.serving.sampling import stop_token_ids

RUN = "run-f"
MAX_TOKENS = 4


def group(finish: list[int], lengths: list[int], rewards: list[float], prompt_id: int = 0) -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt_id=prompt_id,
        engine_id=0,
        prompt_tokens=np.array([5, 6], dtype=np.int32),
        completions=[np.arange(3, 3 + n, dtype=np.int32) for n in lengths],
        logprobs=[np.full(n, -0.5, dtype=np.float32) for n in lengths],
        rewards=rewards,
        version_first=[0] * len(lengths),
        version_last=[0] * len(lengths),
        reward_status=[0] * len(lengths),
        finish_reasons=finish,
    )


# ---------------------------------------------------------------- the wire


def test_vllm_finish_strings_map_to_wire_codes():
    assert FINISH_REASONS == {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}


def test_engine_maps_finish_reasons_and_refuses_unknown_ones():
    from async_rl.generator.rollout import finish_code

    assert [finish_code(r, 0) for r in ("stop", "length", "abort")] == [FINISH_STOP, FINISH_LENGTH, FINISH_ABORT]
    with pytest.raises(RuntimeError, match="prompt 7.*'error'"):
        finish_code("error", 7)


def test_finish_reasons_round_trip():
    g = group([FINISH_STOP, FINISH_LENGTH, FINISH_ABORT], [2, 4, 1], [1.0, 0.0, 0.5])
    _, (back,) = decode_groups(encode_groups(RUN, [g]), RUN)
    assert back.finish_reasons == [FINISH_STOP, FINISH_LENGTH, FINISH_ABORT]


def test_out_of_range_finish_reason_is_rejected():
    parts = encode_groups(RUN, [group([FINISH_STOP, FINISH_LENGTH], [2, 4], [1.0, 0.0])])
    h = msgspec.msgpack.decode(parts[0], type=GroupsHeader)
    g = h.groups[0]
    bad = [g.samples[0], msgspec.structs.replace(g.samples[1], finish_reason=3)]
    h = msgspec.structs.replace(h, groups=[msgspec.structs.replace(g, samples=bad)])
    with pytest.raises(FrameError) as info:
        decode_groups([msgspec.msgpack.encode(h), parts[1], parts[2]], RUN)
    assert info.value.reason == "bad_value" and "finish reason 3" in str(info.value)


# ---------------------------------------------------------------- overlong


def test_dapo_penalty_numbers():
    # max 20 tokens, buffer 8: free up to 12, then -1/8 per token, -1 (x penalty) at 20
    lens = torch.tensor([5, 12, 13, 16, 20])
    got = overlong_penalty(lens, max_tokens=20, buffer_tokens=8, penalty=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.0625, -0.25, -0.5]))


def _algorithm(**cfg) -> Algorithm:
    return Algorithm(
        AlgorithmConfig(**cfg), max_tokens=MAX_TOKENS, temperature=1.0, model_dir="", dtype=torch.float32,
        hidden_size=8, seed=0, max_grad_norm=1.0,
    )


def _shard() -> PaddedShard:
    # one group of 4: lengths 1, 2, 4 (cut), 4 (cut); rewards 1, 0, 1, 0
    return PaddedShard([group([FINISH_STOP, FINISH_STOP, FINISH_LENGTH, FINISH_LENGTH], [1, 2, 4, 4], [1.0, 0.0, 1.0, 0.0])])


def test_shard_carries_truncation_and_lengths():
    b = _shard()
    assert b.truncated.tolist() == [False, False, True, True]
    assert b.completion_lens.tolist() == [1, 2, 4, 4]


def test_overlong_keep_trains_on_everything():
    b = _shard()
    p = _algorithm(overlong="keep").prepare(b, policy=None)
    torch.testing.assert_close(p.advantages, grpo_advantages(b.rewards).reshape(-1, 1))
    assert torch.equal(p.mask, b.loss_mask) and p.denominator == 11.0


def test_overlong_mask_drops_truncated_from_the_loss():
    b = _shard()
    p = _algorithm(overlong="mask").prepare(b, policy=None)
    full = grpo_advantages(b.rewards).reshape(-1)  # the group baseline still sees every reward
    assert p.advantages.reshape(-1).tolist() == pytest.approx([full[0].item(), full[1].item(), 0.0, 0.0])
    assert p.mask[2:].sum() == 0 and torch.equal(p.mask[:2], b.loss_mask[:2])
    assert p.denominator == 3.0  # the token mean counts the kept completions only (1 + 2 tokens)


def test_overlong_penalty_shapes_rewards_before_advantages():
    b = _shard()
    p = _algorithm(overlong="penalty", overlong_buffer_tokens=2, overlong_penalty=1.0, name="dr_grpo").prepare(b, None)
    # lengths 1, 2, 4, 4 with max 4, buffer 2: penalties 0, 0, -1, -1 -> rewards 1, 0, 0, -1 (mean 0)
    assert p.advantages.reshape(-1).tolist() == pytest.approx([1.0, 0.0, 0.0, -1.0])


@pytest.mark.parametrize("layout", [packed, padded])
def test_sample_out_of_the_loss_has_no_loss_mask(layout):
    keep = SeqSample(np.array([1, 2, 3]), 2, np.zeros(1, np.float32), np.ones(1, np.float32))
    out = SeqSample(np.array([1, 2, 3, 4]), 2, np.zeros(2, np.float32), np.ones(2, np.float32), in_loss=False)
    mb = layout([keep, out])
    assert mb.loss_mask.sum() == 1.0 and len(mb.spans) == 2  # still scored, no loss


# ---------------------------------------------------------------- length metrics


def test_length_stats_over_every_rank():
    shards = [
        [group([FINISH_STOP, FINISH_LENGTH], [2, 4], [0.0, 0.0])],
        [group([FINISH_STOP, FINISH_STOP], [1, 3], [0.0, 0.0], prompt_id=1)],
    ]
    per_rank = [
        StepMetrics(
            step=0, rank=r, loss=0, reward_mean=0, kl_behav=0, logprob_abs_diff=0, grad_norm=0, clip_frac=0,
            tis_frac=0, samples=2, tokens=0, wait_s=0, compute_s=0,
            completion_lens=completion_lengths(gs), truncated=truncated_count(gs),
        )
        for r, gs in enumerate(shards)
    ]
    s = length_stats(per_rank)
    assert (s.mean, s.p50, s.max, s.truncation_rate) == (2.5, 2.5, 4, 0.25)
    assert s.p90 == pytest.approx(np.percentile([1, 2, 3, 4], 90))


def test_console_line_shows_lengths_and_truncation():
    from async_rl.control.metrics import StepRecord

    fields = {f.name: 0 for f in msgspec.structs.fields(StepRecord) if f.default is msgspec.NODEFAULT}
    r = StepRecord(**{**fields, "logprob_mismatch": None, "accounting_balanced": True},
                   completion_len_mean=31.4, completion_len_p90=110, completion_len_max=256, truncation_rate=0.125)
    assert "len 31 p90 110 max 256 trunc 12%" in console_line(r, 10)


# ---------------------------------------------------------------- stop tokens and sampling config


def test_stop_tokens_from_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert stop_token_ids(tmp_path) == [2, 7]


def test_stop_tokens_without_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 5}))
    assert stop_token_ids(tmp_path) == [5]


@pytest.mark.parametrize("override", ["generators.top_p=0.9", "generators.top_k=20", "generators.min_p=0.05"])
def test_truncated_sampling_is_refused_for_training(override):
    with pytest.raises(ConfigError, match="truncated sampling"):
        load_config(None, [override])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["generators.top_p=0"], "generators.top_p"),
        (["generators.top_k=-1"], "generators.top_k"),
        (["generators.stop=['']"], "empty stop string"),
        (["algorithm.overlong=clip"], "algorithm.overlong"),
        (["algorithm.overlong=penalty", "algorithm.overlong_buffer_tokens=9"], "overlong_buffer_tokens"),
    ],
)
def test_sampling_and_overlong_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_stop_strings_and_overlong_accepted():
    cfg = load_config(None, ["generators.stop=['</answer>']", "algorithm.overlong=penalty", "algorithm.overlong_buffer_tokens=4"])
    assert cfg.generators.stop == ["</answer>"] and cfg.algorithm.overlong == "penalty"
