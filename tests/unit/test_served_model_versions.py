"""The policy versions a request reports (`ServedModel.generate`): the lowest and highest it was
generated with. A learner recovery syncs an older checkpoint's weights (version 30 after 31); a request
kept across that sync once reported version_last 30 < version_first 31, a frame the buffer rejects as
`bad_value`, and its 8 samples were counted lost (a fresh-clone CI then stopped the TP=2 resume test of
test_megatron_cpu_loop.py as "every generation request failed")."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from async_rl.protocol import FrameError, decode_groups, encode_groups
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel
from tests.unit._learner_fixtures import groups

SPEC = vc.EngineSpec(model_dir="unused", dtype="float32", tensor_parallel_size=1, max_model_len=64,
                     gpu_memory_utilization=0.5, seed=0, max_num_seqs=1)


def generated_across(monkeypatch, before: int, after: int) -> tuple[int, int]:
    """(version_first, version_last) of a request that starts on `before` and ends on `after`."""
    model = ServedModel(SPEC)
    model.version = before
    model.open()

    async def generate(llm, prompt, params, request_id, images=None):
        model.version = after  # a weight sync lands while the request runs (pause mode keep)
        return [1, 2], []

    monkeypatch.setattr(vc, "generate", generate)
    monkeypatch.setattr(vc, "generation_input", lambda ids, text, images=None, prompt_len=0: ids)
    out = asyncio.run(model.generate([1, 2], None, "r"))
    return out.version_first, out.version_last


@pytest.mark.parametrize("before,after", [(30, 30), (31, 32), (31, 30)], ids=["none", "update", "rollback"])
def test_a_request_reports_the_lowest_and_highest_version_it_ran_on(monkeypatch, before, after):
    assert generated_across(monkeypatch, before, after) == (min(before, after), max(before, after))


def test_the_buffer_takes_what_a_request_across_a_rollback_reports_and_rejects_the_reverse(monkeypatch):
    first, last = generated_across(monkeypatch, 31, 30)
    (g,) = groups(0, n_groups=1)
    size = len(g.completions)
    ok = dataclasses.replace(g, version_first=[first] * size, version_last=[last] * size)
    _, (back,) = decode_groups(encode_groups("run", [ok]), "run")
    assert (back.version_first, back.version_last) == ([30] * size, [31] * size)
    reversed_ = dataclasses.replace(g, version_first=[31] * size, version_last=[30] * size)
    with pytest.raises(FrameError) as err:
        decode_groups(encode_groups("run", [reversed_]), "run")
    assert err.value.reason == "bad_value"
