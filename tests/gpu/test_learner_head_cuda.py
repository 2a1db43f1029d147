"""On CUDA: the KL reference and ppo's critic live on the learner's GPU (the critic's gradient
all-reduce then runs on device tensors, what an NCCL group needs), and the chunked head equals the
full head in bf16 autocast within bf16's precision (marked gpu; skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest

from async_rl.cluster.net import free_port
from async_rl.config import AlgorithmConfig
from async_rl.learner.driver import LearnerDriver
from async_rl.models.tiny import resolve_model_path
from tests.unit._learner_fixtures import groups, settings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return resolve_model_path("tiny-qwen2", str(tmp_path_factory.mktemp("models")))


def test_reference_and_critic_on_the_learner_gpu(model_dir):
    algo = AlgorithmConfig(name="ppo", objective="decoupled", kl_coef=0.05)
    rank = LearnerDriver(settings(model_dir, algorithm=algo, micro_batch_tokens=32), 0, 1,
                         f"127.0.0.1:{free_port()}", [])
    rank.setup()
    dev = rank.backend.device
    assert dev.type == "cuda"
    assert {p.device for p in rank.algo.reference.model.parameters()} == {dev}
    assert {p.device for p in rank.algo.critic.head.parameters()} == {dev}
    for k in range(2):
        m = rank.train_on_shard(k, groups(k, n_groups=3, group_size=4))
        assert np.isfinite(m.loss) and np.isfinite(m.value_loss)
    assert {p.grad.device for p in rank.algo.critic.head.parameters()} == {dev}
    rank.shutdown()


def test_chunked_head_matches_full_head_in_bf16(model_dir):
    gs = groups(3, n_groups=3, group_size=4)
    out = []
    for chunk in (0, 5):
        rank = LearnerDriver(settings(model_dir, logprob_chunk_tokens=chunk, mixed_precision="bf16"), 0, 1,
                             f"127.0.0.1:{free_port()}", [])
        rank.setup()
        out.append(rank.compute_logprobs(gs))
        rank.shutdown()
    for a, b in zip(*out, strict=True):
        np.testing.assert_allclose(b, a, atol=5e-2, rtol=0)


def test_compiled_head_equals_the_eager_head_in_bf16_and_compiles_once():
    """learner.head_kernel=compiled (auto on CUDA): the same log-probs and entropies as the eager loop
    (the same bf16 logits, fp32 arithmetic) and gradients within bf16 rounding, on a 151,936-token
    vocabulary; chunk counts and a last, shorter chunk that change between calls do not recompile."""
    import torch
    from torch._dynamo.utils import counters

    from async_rl.learner.model.head import flat_index, head_scores

    def run(fused: bool, n_rows: int, seed: int):
        torch.manual_seed(seed)
        hidden = torch.randn(n_rows, 97, 896, device="cuda", dtype=torch.bfloat16).requires_grad_()
        weight = (0.02 * torch.randn(151936, 896, device="cuda")).to(torch.bfloat16).requires_grad_()
        targets = torch.randint(0, 151936, (n_rows, 97), device="cuda")
        positions = torch.rand(n_rows, 97, device="cuda") > 0.3
        logp, ent = head_scores(hidden, weight, targets, flat_index(positions), 0.9, 256, True, fused)
        ((logp * 0.5).sum() + (ent * 0.1).sum()).backward()
        return logp, ent, hidden.grad.float(), weight.grad.float()

    for rows in (3, 5):
        eager, fused = run(False, rows, rows), run(True, rows, rows)
        torch.testing.assert_close(fused[0], eager[0], atol=2e-4, rtol=0)
        torch.testing.assert_close(fused[1], eager[1], atol=2e-4, rtol=0)
        torch.testing.assert_close(fused[2], eager[2], atol=1e-2, rtol=2e-2)
        torch.testing.assert_close(fused[3], eager[3], atol=1e-2, rtol=2e-2)
        if rows == 3:
            frames = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == frames, "a new chunk count recompiled the head"


def test_the_triton_head_statistics_equal_the_eager_head_in_bf16():
    """learner.head_kernel=triton: `head_triton`'s forward statistics (one online-softmax pass a row)
    give the eager loop's log-probs and entropies, and the same gradients, on Qwen2.5's 151,936-token
    vocabulary (not a multiple of the kernel's block) with bf16 logits at temperature 0.9."""
    import torch

    from async_rl.learner.model.head import flat_index, head_scores

    torch.manual_seed(0)
    hidden = torch.randn(4, 97, 896, device="cuda", dtype=torch.bfloat16)
    weight = (0.02 * torch.randn(151936, 896, device="cuda")).to(torch.bfloat16)
    targets = torch.randint(0, 151936, (4, 97), device="cuda")
    index = flat_index(torch.rand(4, 97, device="cuda") > 0.3)
    out = {}
    for fused in (False, "triton"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = head_scores(h, w, targets, index, 0.9, 256, True, fused)
        ((logp * 0.5).sum() + (ent * 0.1).sum()).backward()
        out[fused] = (logp, ent, h.grad.float(), w.grad.float())
    for a, b, tol in zip(out[False], out["triton"], (2e-4, 2e-4, 1e-2, 1e-2), strict=True):
        torch.testing.assert_close(b, a, atol=tol, rtol=0 if tol < 1e-3 else 2e-2)


def test_auto_measures_every_head_kernel_on_the_gpu_and_the_learner_runs_the_fastest(model_dir, capfd, record_property):
    """learner.head_kernel=auto on CUDA (`head_probe`): eager, compiled and triton all run and are
    timed on Qwen2.5's output-layer shape; a learner with auto states the choice in one line and runs
    that kernel, its KL reference pass too. The probe's line goes into part A's junit XML."""
    import torch

    from async_rl.learner.model import head_probe

    weight = (0.02 * torch.randn(151936, 896, device="cuda")).to(torch.bfloat16)
    probe = head_probe.measure(weight, 1024, torch.bfloat16)
    record_property("head_probe", probe.line())
    assert set(probe.seconds) == {"eager", "compiled", "triton"}, probe.failed
    rank = LearnerDriver(settings(model_dir, algorithm=AlgorithmConfig(kl_coef=0.05)), 0, 1,
                         f"127.0.0.1:{free_port()}", [])
    rank.setup()
    chosen = rank.backend.head_kernel
    assert rank.backend.head_probe is not None and chosen == rank.backend.head_probe.fastest
    assert f"learner.head_kernel auto: {chosen}, the fastest here" in capfd.readouterr().err
    assert rank.algo.reference.fused == head_probe.FUSED[chosen]
    m = rank.train_on_shard(0, groups(0, n_groups=2, group_size=4))
    assert np.isfinite(m.loss)
    rank.shutdown()


@pytest.mark.parametrize("fused", [True, "triton"])
def test_kept_logits_give_the_recomputing_heads_results_in_bf16_on_both_backends_heads(fused):
    """learner.logprob_keep_logits (auto: on CUDA): the torch head's and megatron's one-rank head, fused
    (compiled, and Triton's statistics), give the same log-probs, entropies and gradients with the
    chunks' bf16 logits kept from the forward as with them recomputed (the same GEMM of the same
    operands), on Qwen2.5's 151,936-token vocabulary."""
    import torch

    from async_rl.learner.megatron.head import VocabShard, chunked_scores
    from async_rl.learner.model.head import ChunkedHead

    torch.manual_seed(0)
    hidden = torch.randn(300, 896, device="cuda", dtype=torch.bfloat16)
    weight = (0.02 * torch.randn(151936, 896, device="cuda")).to(torch.bfloat16)
    targets = torch.randint(0, 151936, (300,), device="cuda")
    g_logp, g_ent = torch.randn(300, device="cuda"), torch.randn(300, device="cuda")
    heads = {
        "torch": lambda h, w, keep: ChunkedHead.apply(h, w, targets, 0.9, 128, True, fused, keep),
        "megatron": lambda h, w, keep: chunked_scores(h, w, targets, 0.9, 128, VocabShard.of(151936, 151936, 0, None),
                                                      True, fused, keep),
    }
    for name, head in heads.items():
        out = {}
        for keep in (False, True):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            logp, ent = head(h, w, keep)
            ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
            out[keep] = (logp, ent, h.grad.float(), w.grad.float())
        for a, b in zip(out[False], out[True], strict=True):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name} head: {m}")
