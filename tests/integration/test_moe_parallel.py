"""An MoE model (tiny Qwen3-MoE, routing replay on, activation checkpointing) over 2 CPU ranks on gloo,
FSDP2 and DDP: both ranks train the same shard, so the step is one replica's; the routing metrics are
reduced over the group (every rank reports the same, counting both ranks' tokens). Unshared prompts: the
routed-token count is then the same whatever the micro-batch cut."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from async_rl.cluster.net import free_port
from async_rl.learner.driver import LearnerDriver
from tests.integration._moe_worker import moe_shard, run_rank
from tests.unit._learner_fixtures import settings
from tests.unit._moe_fixtures import build_moe_dir

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, model_cache):
    from async_rl.models.tiny import resolve_model_path

    return str(build_moe_dir("qwen3_moe", tmp_path_factory.mktemp("moe"), resolve_model_path("tiny-qwen2", model_cache)))


@pytest.mark.parametrize("parallel", ["fsdp2", "ddp"])
def test_two_ranks_replay_and_match_one_replica(tmp_path, moe_dir, parallel):
    master = f"127.0.0.1:{free_port()}"
    mp.spawn(run_rank, args=(2, master, moe_dir, parallel, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    single = LearnerDriver(settings(moe_dir, activation_checkpointing=True, routing_probe_samples=2, share_prompt=False),
                           0, 1, "", [])
    single.setup()
    alone = [single.train_on_shard(k, moe_shard(k)) for k in range(2)]
    for k, one in enumerate(alone):
        assert ranks[0][k]["loss"] == pytest.approx(one.loss, abs=1e-5)
        assert ranks[0][k]["moe"] == ranks[1][k]["moe"]  # reduced over the group
        moe = ranks[0][k]["moe"]
        assert moe["replay"] and moe["routed_tokens"] == 2 * one.moe.routed_tokens
        assert moe["unrouted_tokens"] == 2 * one.moe.unrouted_tokens > 0
        assert moe["router_agreement"] == pytest.approx(one.moe.router_agreement)
        assert moe["mismatch_replay"] == pytest.approx(one.moe.mismatch_replay, rel=1e-4)
