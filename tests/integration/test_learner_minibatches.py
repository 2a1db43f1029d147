"""train.minibatches with data-parallel ranks: two gloo ranks, each cutting its two groups into two
mini-batches (two epochs), take the four optimizer steps one rank takes on the whole batch whose
mini-batch k is both ranks' k-th groups (the token mean is the global mini-batch's). A NaN gradient
on one rank only skips the step on both."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from async_rl.cluster.net import free_port
from tests.integration._minibatch_worker import make_learner, run_rank, shard, weights

pytestmark = pytest.mark.integration


def test_two_ranks_take_the_single_rank_mini_batch_steps_and_skip_together(tmp_path, model_cache):
    from async_rl.models.tiny import resolve_model_path

    model_dir = str(resolve_model_path("tiny-qwen2", model_cache))
    mp.spawn(run_rank, args=(2, f"127.0.0.1:{free_port()}", model_dir, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [r["metrics"].updates for r in ranks] == [4, 4]

    (a0, a1), (b0, b1) = shard(0), shard(1)
    single = make_learner(model_dir, 0, 1, "")
    m = single.train_on_shard(0, [a0, b0, a1, b1])  # mini-batch 1 = both ranks' first groups
    norms = [u.grad_norm for u in single.last_updates]
    want = weights(single)
    single.shutdown()
    assert m.updates == 4
    for r in ranks:
        # Each update's gradient (its norm: the global mini-batch's token mean, not a per-rank one)...
        assert r["norms"] == pytest.approx(norms, rel=1e-4)  # the later updates: after AdamW steps (below)
        # ... and the weights after four AdamW steps (lr 1e-2). Adam divides by the gradient's own
        # scale, so summation-order noise in a near-zero gradient element can move that element by up
        # to lr per step: all but a sliver of the elements agree to 1e-4, none beyond Adam's bound.
        for name, t in want.items():
            diff = (r["trained"][name] - t).abs()
            assert float((diff > 1e-4).float().mean()) < 1e-3, (name, float(diff.max()))
            assert float(diff.max()) <= 4 * 1e-2 + 1e-6, (name, float(diff.max()))

    for r in ranks:  # rank 0's own gradient was finite: it skipped because rank 1's was not
        assert r["skipped"].nonfinite_steps == 4
        for name, t in r["trained"].items():
            assert torch.equal(r["after_skip"][name], t), name
