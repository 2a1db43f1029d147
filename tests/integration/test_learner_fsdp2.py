"""FSDP2 (torch.distributed.fsdp.fully_shard) over 2 CPU ranks on gloo: trains like one replica,
gathers full HF weights on rank 0, and checkpoints that a fresh FSDP2 group restores exactly."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from async_rl.cluster.net import free_port
from async_rl.learner.base import checkpoint_model_dir
from async_rl.learner.driver import LearnerDriver
from async_rl.learner.hf_io import read_hf_weights
from async_rl.weight_sync.checksum import checksum_of
from tests.integration._fsdp_worker import run_rank
from tests.unit._learner_fixtures import groups, settings

pytestmark = pytest.mark.integration


def _run(rank, world, master, model_dir, out):
    run_rank(rank, world, master, model_dir, out)


def test_fsdp2_two_ranks_match_one_replica_and_round_trip(tmp_path, model_cache):
    from async_rl.models.tiny import resolve_model_path

    model_dir = str(resolve_model_path("tiny-qwen2", model_cache))
    master = f"127.0.0.1:{free_port()}"
    mp.spawn(_run, args=(2, master, model_dir, str(tmp_path)), nprocs=2, join=True)
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["step"] == 2 and report["same_after_load"]
    assert report["during_step"] == [False, True, True]
    assert report["micro_batches"] == [3, 3]  # rank 0's count (rank 1 had 2 and ran a dummy)

    # Both ranks trained on the same shard, so the averaged gradient is one replica's: compare.
    single = LearnerDriver(settings(model_dir), 0, 1, "", [])
    single.setup()
    losses = [single.train_on_shard(k, groups(20 + k)).loss for k in range(2)]
    assert losses == pytest.approx(report["loss"], abs=1e-6)
    saved = read_hf_weights(checkpoint_model_dir(tmp_path / "ckpt"))
    names = [n for n, _ in single.backend.model.named_parameters()]
    assert report["names"] == sorted(names) and "lm_head.weight" not in saved  # tied: stored once
    # Sharded reductions sum in another order; AdamW turns those last-bit differences of near-zero
    # gradients into full steps for a few elements, so allow 5% of the two steps' largest move (2 * lr).
    initial = read_hf_weights(model_dir)
    moved = max(float((initial[n] - p.detach()).abs().max()) for n, p in single.backend.model.named_parameters())
    assert moved > 1e-2  # the weights really moved
    for name, p in single.backend.model.named_parameters():
        torch.testing.assert_close(saved[name], p.detach(), atol=1e-3, rtol=0, msg=name)
    ck = checksum_of(saved[n] for n in names)
    assert [ck.total, ck.sum_sq, ck.count] == pytest.approx(report["checksum"], rel=1e-12)
