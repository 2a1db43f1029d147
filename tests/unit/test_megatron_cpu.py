"""The learner.megatron.cpu patches against the installed megatron-core: they must be complete for its
version, or fail here naming the version and the place that broke (run after any upgrade).

One gloo rank (TP=PP=1): forward, backward and megatron's own fp32 optimizer step on CPU.
Starts torch.distributed (two gloo ranks on loopback). The two-rank TP/PP tests are in
test_megatron_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.learner.megatron import convert as mcv  # noqa: E402
from async_rl.learner.megatron import cpu as megatron_cpu  # noqa: E402
from tests.unit._megatron_models import fixed_batch, on_policy_loss, one_rank_model_parallel, tiny_qwen2  # noqa: E402

UPGRADE = (
    f"megatron-core {megatron_cpu.installed_version()} (learner.megatron.cpu is verified with "
    f"{megatron_cpu.VERIFIED_VERSION})"
)


def test_installed_megatron_core_is_the_verified_version():
    assert megatron_cpu.installed_version() == megatron_cpu.VERIFIED_VERSION, (
        f"{UPGRADE}: re-run tests/unit/test_megatron_cpu.py and test_megatron_parallel.py with the new "
        "version, fix learner/megatron/cpu.py, then update VERIFIED_VERSION"
    )


def test_every_patched_place_still_exists():
    assert megatron_cpu.check_targets() == [], UPGRADE


def test_a_newer_version_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(megatron_cpu, "installed_version", lambda: "9.9.9")
    with pytest.raises(megatron_cpu.CpuSupportError, match=r"megatron-core 9\.9\.9 is installed; .* verified with"):
        with megatron_cpu.patched():
            pass


def test_patches_are_undone_after_the_block():
    current = torch.cuda.current_device
    with megatron_cpu.patched():
        assert torch.cuda.current_device() == "cpu"
    assert torch.cuda.current_device is current


def test_unsupported_settings_are_refused_in_one_line():
    with pytest.raises(megatron_cpu.CpuSupportError, match="float32 only"):
        megatron_cpu.check_config(dtype=torch.bfloat16, distributed_optimizer=False, te_spec=False)
    with pytest.raises(megatron_cpu.CpuSupportError, match="distributed_optimizer=false"):
        megatron_cpu.check_config(dtype=torch.float32, distributed_optimizer=True, te_spec=False)


@pytest.fixture(scope="module")
def one_rank():
    with one_rank_model_parallel():
        yield


def test_forward_backward_and_megatron_optimizer_step_run_on_cpu(one_rank):
    """What a learner rank does, through megatron's own schedule, DDP and optimizer (no stand-ins)."""
    from async_rl.learner.megatron.learner import MegatronPolicy, megatron_optimizer

    hf = tiny_qwen2()
    arch = mcv.arch_from_hf_config(hf.config)
    stage = "building the model and megatron's optimizer"
    try:
        with megatron_cpu.patched():
            policy = MegatronPolicy(
                arch, dict(hf.named_parameters()), dtype=torch.float32, lr=1e-3, weight_decay=0.0,
                max_grad_norm=1.0, distributed_optimizer=False, te_spec=False, cpu_init=True,
                make_optimizer=lambda ddp: megatron_optimizer(ddp, torch.float32, 1e-3, 0.0, 1.0, False),
            )
            b = fixed_batch(arch.vocab_size)
            stage = "the forward-only schedule"
            b.behav_logp = policy.logprobs(b.input_ids).detach() * b.loss_mask
            before = {n: t.clone() for n, t in policy.hf_state_dict().items()}  # TP=1: live parameters
            stage = "forward, backward and the optimizer step"
            stats, grad_norm = policy.train_batch(b, 2, 1.0, 0.2, 0.2, 2.0)
    except Exception as e:
        raise AssertionError(f"{UPGRADE}: {stage} failed on CPU: {type(e).__name__}: {e}") from e
    assert abs(stats.loss - on_policy_loss(b)) < 1e-5
    assert grad_norm > 0
    after = policy.hf_state_dict()
    assert not torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])


def test_full_recompute_gives_the_same_loss_and_update(one_rank):
    """learner.activation_checkpointing on megatron (full recompute per layer): the same loss, gradient
    norm and updated weights as keeping every activation."""
    from async_rl.learner.megatron.learner import MegatronPolicy, megatron_optimizer

    hf = tiny_qwen2()
    arch = mcv.arch_from_hf_config(hf.config)
    results = []
    with megatron_cpu.patched():
        for recompute in (False, True):
            torch.manual_seed(0)
            policy = MegatronPolicy(
                arch, dict(hf.named_parameters()), dtype=torch.float32, lr=1e-3, weight_decay=0.0,
                max_grad_norm=1.0, distributed_optimizer=False, te_spec=False, cpu_init=True,
                make_optimizer=lambda ddp: megatron_optimizer(ddp, torch.float32, 1e-3, 0.0, 1.0, False),
                recompute=recompute,
            )
            assert (policy.config.recompute_granularity == "full") is recompute
            b = fixed_batch(arch.vocab_size)
            b.behav_logp = policy.logprobs(b.input_ids).detach() * b.loss_mask
            layers = policy.model.module.decoder.layers
            calls = []
            hooks = [layer.register_forward_pre_hook(lambda *_, c=calls: c.append(1)) for layer in layers]
            stats, grad_norm = policy.train_batch(b, 2, 1.0, 0.2, 0.2, 2.0)
            for h in hooks:
                h.remove()
            # train_batch(b, 2, ...): two micro-batches, each entering every layer once; recompute
            # enters every layer again in backward.
            assert len(calls) == len(layers) * 2 * (2 if recompute else 1)
            results.append((stats.loss, grad_norm, policy.hf_state_dict()))
    (loss0, norm0, after0), (loss1, norm1, after1) = results
    assert loss1 == pytest.approx(loss0, abs=1e-6) and norm1 == pytest.approx(norm0, rel=1e-5)
    for name, t in after0.items():
        torch.testing.assert_close(after1[name], t, atol=1e-6, rtol=0, msg=name)
