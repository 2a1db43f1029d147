"""learner.mixed_precision=bf16_params on the CPU: the bf16 working copy gives autocast's step within
bf16 rounding, and casts the weights once per optimizer step, not once per micro-batch (counted at the
dispatcher: every fp32 -> bf16 copy whose source is a master parameter's storage)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from async_rl.learner.driver import LearnerDriver
from tests.unit._learner_fixtures import groups, settings


def rank(model_dir, **learner) -> LearnerDriver:
    torch.manual_seed(0)
    r = LearnerDriver(settings(model_dir, **learner), 0, 1, "", [])
    r.setup()
    return r


class WeightCasts(TorchDispatchMode):
    """Counts fp32 -> bf16 casts of the given parameters' storages (per parameter cast)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.sources = {p.data_ptr() for p in params}
        self.count = 0

    def _seen(self, src, dst_dtype) -> None:
        if isinstance(src, torch.Tensor) and src.dtype == torch.float32 and dst_dtype == torch.bfloat16:
            self.count += src.data_ptr() in self.sources

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_to_copy":
            self._seen(args[0], kwargs.get("dtype"))
        elif name == "copy_":
            self._seen(args[1], args[0].dtype)
        elif name == "_foreach_copy_":
            for dst, src in zip(args[0], args[1], strict=True):
                self._seen(src, dst.dtype)
        return func(*args, **kwargs)


def casts_per_step(r: LearnerDriver, steps: int) -> list[int]:
    params = list(r.backend.model.parameters())
    out = []
    for s in range(steps):
        with WeightCasts(params) as mode:
            r.train_on_shard(s, groups(s))
        out.append(mode.count)
    return out


def test_working_copy_step_equals_autocast_within_bf16_rounding(model_dir):
    auto, work = rank(model_dir, mixed_precision="bf16"), rank(model_dir, mixed_precision="bf16_params")
    assert work.backend.working is not None and auto.backend.working is None
    assert work.backend.model.dtype == torch.float32  # the masters (optimizer, sync) stay fp32
    assert work.backend.working.module.dtype == torch.bfloat16
    a, b = (np.concatenate(r.compute_logprobs(groups(0), 1.0)) for r in (auto, work))
    # autocast keeps the residual stream and norms in fp32; the working copy runs them in bf16.
    assert np.abs(a - b).mean() < 0.03 and np.abs(a - b).max() < 0.15
    m_auto, m_work = auto.train_on_shard(0, groups(0)), work.train_on_shard(0, groups(0))
    assert m_work.loss == pytest.approx(m_auto.loss, rel=0.05, abs=1e-3)
    assert m_work.grad_norm == pytest.approx(m_auto.grad_norm, rel=0.05)
    # The update (fp32 masters, fp32 AdamW) agrees: AdamW's first step is ~lr * sign(grad).
    w0 = rank(model_dir, mixed_precision="none").backend.model.state_dict()
    delta = {n: (p.detach() - w0[n]).flatten() for n, p in work.backend.model.named_parameters()}
    ref = {n: (p.detach() - w0[n]).flatten() for n, p in auto.backend.model.named_parameters()}
    cos = torch.nn.functional.cosine_similarity(torch.cat(list(delta.values())), torch.cat(list(ref.values())), dim=0)
    assert cos > 0.9
    # After the step the working copy is re-cast from the new masters before it scores.
    after = np.concatenate(work.compute_logprobs(groups(1), 1.0))
    fresh = rank(model_dir, mixed_precision="bf16_params")
    with torch.no_grad():
        for p, q in zip(fresh.backend.model.parameters(), work.backend.model.parameters(), strict=True):
            p.copy_(q)
    fresh.backend.working.mark_stale()
    np.testing.assert_array_equal(after, np.concatenate(fresh.compute_logprobs(groups(1), 1.0)))


def test_weights_are_cast_once_per_optimizer_step_not_per_micro_batch(model_dir):
    # micro_batch_size 1: six micro-batches per step.
    work = rank(model_dir, mixed_precision="bf16_params", micro_batch_size=1, micro_batch_tokens=0)
    n_params = len(list(work.backend.model.parameters()))
    # Step 0 runs on the copy made at setup; each later step re-casts every parameter once.
    assert casts_per_step(work, 3) == [0, n_params, n_params]
    assert work.backend.working.refreshes == 2
    auto = rank(model_dir, mixed_precision="bf16", micro_batch_size=1, micro_batch_tokens=0)
    per_step = casts_per_step(auto, 1)[0]
    matmul_weights = sum(1 for p in auto.backend.model.parameters() if p.dim() == 2)
    assert per_step >= 6 * (matmul_weights - 1)  # autocast: every matmul weight again per micro-batch


def _reduce_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from async_rl.learner.model import precision
    from async_rl.learner.model.precision import WorkingCopy, all_reduce_grads

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    precision.REDUCE_BUCKET = 100  # several buckets, one parameter larger than a bucket
    torch.manual_seed(0)
    master = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 4, bias=False))
    work = WorkingCopy(master)
    for _ in range(2):  # two micro-batches: fp32 accumulation in the masters
        x = torch.randn(5, 12, generator=torch.Generator().manual_seed(10 * rank + _)).to(torch.bfloat16)
        work.module(x).float().square().sum().backward()
    local = [p.grad.clone() for p in master.parameters()]
    all_reduce_grads(list(master.parameters()))
    torch.save({"local": local, "reduced": [p.grad for p in master.parameters()]}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_fp32_gradients_are_summed_over_ranks_in_buckets(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_reduce_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    for a, b, g0, g1 in zip(r0["local"], r1["local"], r0["reduced"], r1["reduced"], strict=True):
        assert g0.dtype == torch.float32 and not torch.equal(a, b)
        torch.testing.assert_close(g0, a + b, rtol=0, atol=0)
        torch.testing.assert_close(g1, a + b, rtol=0, atol=0)
