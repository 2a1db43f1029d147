"""GPU tier, part A: an MoE model's experts and routing replay on CUDA (learner/model/moe.py).

- transformers' grouped experts (torch's grouped matmul, bf16) equal HF's loop over the experts within
  bf16's tolerance, values and gradients;
- an MoE block's forward and backward under routing replay make no host sync (CUDA's sync debug mode
  raises on one): routing, the replayed weights' gather, the per-expert counts and the token permutation
  stay on the device;
- a whole learner step on the tiny Qwen3-MoE replays the recorded experts on CUDA.
"""

from __future__ import annotations

import torch

from async_rl.learner.batch.routes import ROUTE_LIVE
from async_rl.learner.model.moe import RouterReplay, routers
from async_rl.models.tiny_moe import build
from tests.unit._moe_fixtures import SHAPE, VOCAB

CUDA = torch.device("cuda", 0)


def tiny_moe(dtype: torch.dtype, experts: str):
    model = build(SHAPE, VOCAB, dtype=dtype).to(CUDA)
    model.set_experts_implementation(experts)
    return model


def test_grouped_experts_equal_the_loop_in_bf16():
    loop, grouped = tiny_moe(torch.bfloat16, "eager"), tiny_moe(torch.bfloat16, "grouped_mm")
    x = torch.randn(2, 48, SHAPE.hidden_size, device=CUDA, dtype=torch.bfloat16)
    outs, grads = [], []
    for model in (loop, grouped):
        xi = x.clone().requires_grad_(True)
        out = model.model.layers[0].mlp(xi)
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append(xi.grad.float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grads[1], grads[0], atol=5e-2, rtol=5e-2)


def test_a_replayed_moe_block_makes_no_host_sync():
    model = tiny_moe(torch.bfloat16, "grouped_mm")
    replay = RouterReplay(model)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 64, SHAPE.hidden_size, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    routes = torch.randint(0, SHAPE.experts, (2, 64, 2, 2), device=CUDA, dtype=torch.int32)
    routes[:, ::5] = ROUTE_LIVE
    block(x).sum().backward()  # warm-up: lazy initialisations may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with replay.plan(routes, replay=True, aux=True) as plan:
            out = block(x)
            (out.float().sum() + plan.aux_loss[0]).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert routers(model)[0].weight.grad is not None


def test_a_learner_step_replays_on_cuda(tmp_path):
    from async_rl.models.tiny import resolve_model_path
    from tests.unit._learner_fixtures import groups, make_rank
    from tests.unit._moe_fixtures import build_moe_dir, random_routes

    d = build_moe_dir("qwen3_moe", tmp_path / "moe", resolve_model_path("tiny-qwen2", str(tmp_path / "models")))
    rank = make_rank(d, device="cuda")
    gs = random_routes(groups(0, n_groups=3, group_size=3), 2, 2, 8, seed=1, missing_every=5)
    m = rank.train_on_shard(0, gs)
    assert m.moe.replay and m.moe.routed_tokens > 0 and m.moe.mismatch_replay is not None
    assert m.loss == m.loss
