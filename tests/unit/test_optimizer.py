"""The torch backend's AdamW kernel (learner/optimizer.py): the same update as the reference AdamW."""

from __future__ import annotations

import pytest
import torch

from async_rl.learner.optimizer import ADAMW_KERNELS, BETAS, adamw
from tests.unit._learner_fixtures import groups, make_rank


def reference(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's AdamW as the learner ran it before: the CPU default, one parameter at a time."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=BETAS, foreach=False, fused=False)


@pytest.mark.parametrize("kernel", ADAMW_KERNELS)
def test_kernel_updates_as_the_reference(kernel):
    """Five steps on a model-like parameter set (an embedding, matrices, norm vectors), weight decay
    on, gradients of mixed scale: every parameter ends where the reference's does (float roundings)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(500, 32), (32, 32), (96, 32), (32,), (1,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt, ref_opt = adamw(ours, lr=1e-2, weight_decay=0.1, kernel=kernel), reference(ref, lr=1e-2, weight_decay=0.1)
    for step in range(5):
        for p, q in zip(ours, ref, strict=True):
            g = torch.randn(p.shape, generator=gen) * 10.0 ** (step - 3)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, q, t in zip(ours, ref, init, strict=True):
        assert (q - t).abs().max() > 1e-3  # the parameters moved
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_learner_step_updates_as_the_reference(model_dir):
    """Two learner steps of the torch backend (its own AdamW kernel, the gradients it computed and
    clipped) against the reference AdamW fed the same gradients: the same weights after each."""
    rank = make_rank(model_dir)
    model, opt = rank.backend.model, rank.backend.optimizer
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters() if p.requires_grad]
    ref = reference(copies, lr=opt.param_groups[0]["lr"], weight_decay=opt.param_groups[0]["weight_decay"])
    seen: list[float] = []

    def feed_reference(optimizer, args, kwargs):  # the gradients the learner's step is about to apply
        seen.append(optimizer.param_groups[0]["lr"])
        for q, p in zip(copies, optimizer.param_groups[0]["params"], strict=True):
            q.grad = p.grad.detach().clone()
        for group in ref.param_groups:
            group["lr"] = optimizer.param_groups[0]["lr"]
        ref.step()

    opt.register_step_pre_hook(feed_reference)
    for k in range(2):
        rank.train_on_shard(k, groups(k))
        live = dict(model.named_parameters())
        for name, q in zip(names, copies, strict=True):
            torch.testing.assert_close(live[name].detach(), q.detach(), rtol=0, atol=1e-6, msg=name)
    assert len(seen) == 2  # both steps went through the optimizer
