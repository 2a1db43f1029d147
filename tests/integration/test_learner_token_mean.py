"""Loss aggregation is the token mean over the global batch: two data-parallel gloo ranks with
unequal token counts produce the gradient one rank produces on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from async_rl.cluster.net import free_port
from tests.integration._token_mean_worker import gradients, make_learner, run_rank, shard

pytestmark = pytest.mark.integration


def test_two_ranks_with_unequal_tokens_give_the_whole_batch_gradient(tmp_path, model_cache):
    from async_rl.models.tiny import resolve_model_path

    model_dir = str(resolve_model_path("tiny-qwen2", model_cache))
    tokens = [sum(len(c) for g in shard(r) for c in g.completions) for r in (0, 1)]
    assert tokens[0] * 2 < tokens[1]  # really unequal: a per-rank mean would weight rank 0's tokens up
    mp.spawn(run_rank, args=(2, f"127.0.0.1:{free_port()}", model_dir, str(tmp_path)), nprocs=2, join=True)
    two = torch.load(tmp_path / "grads.pt")

    single = make_learner(model_dir, 0, 1, "")
    single.train_on_shard(0, shard(0) + shard(1))
    one = gradients(single)
    single.shutdown()
    assert sorted(two) == sorted(one) and len(one) > 0
    for name, g in one.items():
        torch.testing.assert_close(two[name], g, atol=1e-6, rtol=1e-4, msg=name)
