"""Megatron-core GPTModel on CPU: construction with use_cpu_initialization (gloo, world size 1,
TP=PP=1), an exact HF -> Megatron -> HF round trip of the weights, and log-probs against the HF model.

megatron-core allocates a few things on 'cuda' unconditionally (the RoPE frequencies, the CUDA RNG
tracker's fork around attention dropout, a token counter in the pipeline schedules);
`megatron.cpu.patched()` redirects exactly those for the forward/backward tests. The GPU tier runs the same comparison without it (tests/gpu/test_megatron_gpu.py).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.learner.megatron import convert as mcv  # noqa: E402
from async_rl.learner.megatron import cpu as megatron_cpu  # noqa: E402
from async_rl.learner.megatron import model as mm  # noqa: E402
from async_rl.learner.rl.algorithms import token_logprobs  # noqa: E402
from tests.unit._megatron_models import (  # noqa: E402
    fixed_batch,
    megatron_copy,
    on_policy_loss,
    one_rank_model_parallel,
    tiny_llama,
    tiny_qwen2,
    tiny_qwen3,
)


@pytest.fixture(scope="module")
def model_parallel():
    with one_rank_model_parallel():
        yield


MODELS = {"qwen2": tiny_qwen2, "llama": tiny_llama, "qwen3": tiny_qwen3}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, model_parallel):
    """(HF model, arch, Megatron GPTModel loaded with the HF weights)."""
    hf = MODELS[request.param]().eval()
    arch, model = megatron_copy(hf)
    return hf, arch, model.eval()


def test_construction_on_cpu_has_the_local_spec_parameters(pair):
    hf, arch, model = pair
    names = set(mm.parameters_by_name(model))
    assert "decoder.layers.0.input_layernorm.weight" in names  # local spec: separate norms
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" not in names
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in names) == arch.qkv_bias
    assert ("output_layer.weight" in names) == (not arch.tie_embeddings)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())


def test_final_norm_without_transformer_engine_is_torchs_even_where_apex_is_installed(model_parallel, monkeypatch):
    """Where Apex is importable and TE is not, megatron makes Apex's FusedLayerNorm the final norm of a
    block built from a layer spec alone, and it asserts on RMSNorm. The local spec's block names
    torch's norm itself: the model builds and its final norm is torch's RMSNorm."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import transformer_block

    monkeypatch.setattr(transformer_block, "LayerNormImpl", FusedLayerNorm)  # what `import apex` selects
    arch = mcv.arch_from_hf_config(tiny_llama().config)
    config = mm.transformer_config(arch, torch.float32, cpu_init=True, pipeline=1)
    spec = mm.decoder_spec(config, te_spec=False)
    assert spec.layer_norm is not FusedLayerNorm and len(spec.layer_specs) == arch.num_layers
    model = mm.build_model(arch, torch.float32, cpu_init=True, te_spec=False)
    assert isinstance(model.decoder.final_layernorm, torch.nn.RMSNorm)
    assert model.decoder.final_layernorm.eps == arch.rms_eps
    with pytest.raises(AssertionError, match="not supported in FusedLayerNorm"):  # megatron's own choice
        GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                 vocab_size=64, max_sequence_length=arch.max_position_embeddings)


def test_hf_to_megatron_to_hf_round_trip_is_exact(pair):
    hf, arch, model = pair
    back = mm.hf_state_dict(model, arch, te_spec=False)
    ref = dict(hf.named_parameters())
    assert list(back) == list(ref)
    for name, t in ref.items():
        assert torch.equal(back[name], t), name


def test_loading_refuses_a_checkpoint_that_does_not_cover_the_model(pair):
    hf, arch, model = pair
    weights = dict(hf.named_parameters())
    weights.pop("model.layers.1.mlp.down_proj.weight")
    with pytest.raises(KeyError, match="down_proj"):
        mm.load_hf_weights(model, weights, arch, te_spec=False)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_megatron_logprobs_match_the_hf_model_on_cpu(pair, temperature):
    hf, arch, model = pair
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, arch.vocab_size, (3, 17), generator=gen)
    with torch.no_grad():
        ref = token_logprobs(hf(input_ids=ids).logits[:, :-1], ids[:, 1:], temperature)
        with megatron_cpu.patched():
            logits = mm.forward_logits(model, ids)
        got = mm.vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], arch.vocab_size, temperature)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()
    # a wrong layout (say K and V swapped) would not be this close: prove the test can tell
    assert (got - token_logprobs(torch.zeros_like(logits[:, :-1]), ids[:, 1:])).abs().max() > 1e-2


def test_padded_vocabulary_columns_do_not_change_logprobs(model_parallel):
    """TP pads the vocabulary: the extra columns must get no probability mass."""
    logits = torch.randn(2, 5, 48)
    targets = torch.randint(0, 48, (2, 5))
    padded = torch.cat([logits, torch.full((2, 5, 4), 30.0)], dim=-1)  # large junk logits in padding
    got = mm.vocab_parallel_logprobs(padded, targets, vocab_size=48)
    assert torch.allclose(got, token_logprobs(logits, targets), atol=1e-6)
    before = padded.clone()
    mm.vocab_parallel_logprobs(padded, targets, vocab_size=52)
    assert torch.equal(padded, before)  # megatron's CE writes into its input: ours is a copy


def test_safetensors_checkpoint_reads_a_saved_model(tmp_path):
    hf = tiny_qwen2()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = mm.SafetensorsCheckpoint(tmp_path)
    for name, t in hf.named_parameters():
        assert torch.equal(ckpt[name], t.detach()), name
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        ckpt["nope"]


def test_megatron_unavailable_env_is_not_needed_for_import():
    # the backend modules import megatron lazily: importing them must not pull it in by itself
    import subprocess
    import sys

    code = (
        "import sys; import async_rl.learner.megatron.model, async_rl.learner.megatron.convert; "
        "import async_rl.learner.megatron.learner; print('megatron' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    assert out.stdout.strip() == "False"


class CpuAdamOnMainGrads:
    """Stand-in for megatron's optimizer on CPU (its code allocates on 'cuda' unconditionally): Adam
    over the gradients megatron's DDP accumulated in `param.main_grad`, clipped like megatron's."""

    def __init__(self, ddp: torch.nn.Module, lr: float, max_grad_norm: float) -> None:
        self.params = list(ddp.parameters())
        self.max_grad_norm = max_grad_norm
        self.adam = torch.optim.Adam(self.params, lr=lr, betas=(0.9, 0.99))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def zero_grad(self) -> None:
        self.adam.zero_grad(set_to_none=True)

    def step(self) -> tuple[bool, float, None]:
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.adam.step()
        return True, float(norm), None


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_policy_steps_lower_the_loss_and_export_what_it_trained(model_parallel, distributed_optimizer):
    """MegatronPolicy on CPU: megatron's DDP grad buffers (laid out for the distributed optimizer or
    not), the no-pipelining schedule with two micro-batches, our loss through vocab-parallel CE; a
    few steps on a fixed on-policy batch lower the PPO loss, and the weights exported under HF names
    give an HF model the same log-probs as the trained Megatron model. Megatron's own optimizer needs
    CUDA: tests/gpu/test_megatron_gpu.py runs this with it."""
    from async_rl.learner.megatron.learner import MegatronPolicy

    hf = tiny_qwen2()
    arch = mcv.arch_from_hf_config(hf.config)
    with megatron_cpu.patched():
        policy = MegatronPolicy(
            arch,
            dict(hf.named_parameters()),
            dtype=torch.float32,
            lr=3e-3,
            weight_decay=0.0,
            max_grad_norm=1.0,
            distributed_optimizer=distributed_optimizer,
            te_spec=False,
            cpu_init=True,
            make_optimizer=lambda ddp: CpuAdamOnMainGrads(ddp, lr=3e-3, max_grad_norm=1.0),
        )
        b = fixed_batch(arch.vocab_size)
        start = policy.logprobs(b.input_ids)
        b.behav_logp = start.detach() * b.loss_mask  # on-policy: the loss starts at -mean(A)
        losses = []
        for _ in range(4):
            stats, grad_norm = policy.train_batch(b, 2, 1.0, 0.2, 0.2, 2.0)
            losses.append(stats.loss)
            assert grad_norm > 0
        after = policy.logprobs(b.input_ids)
        exported = policy.hf_state_dict()
    assert losses[-1] < losses[0] - 1e-3, losses
    assert abs(losses[0] - on_policy_loss(b)) < 1e-5
    assert not torch.equal(exported["model.embed_tokens.weight"], hf.model.embed_tokens.weight)
    hf.load_state_dict(exported, strict=False)  # tied lm_head follows the embedding
    with torch.no_grad():
        ref = token_logprobs(hf(input_ids=b.input_ids).logits[:, :-1], b.input_ids[:, 1:])
    assert torch.allclose(after, ref, atol=1e-5), (after - ref).abs().max()


def test_the_fused_swiglu_equals_the_unfused_mlp(pair, monkeypatch):
    """Off the CPU the MLP runs megatron's SwiGLU fusion (`bias_activation_fusion`: torch.compile'd
    forward and backward); the CPU keeps the unfused ops. Both give one layer's MLP the same output,
    input gradient and weight gradients."""
    from megatron.core.transformer import mlp as megatron_mlp

    fused_calls = []
    fused_impl = megatron_mlp.bias_swiglu_impl
    monkeypatch.setattr(megatron_mlp, "bias_swiglu_impl", lambda *a, **k: fused_calls.append(1) or fused_impl(*a, **k))
    _, arch, model = pair
    assert mm.transformer_config(arch, torch.float32, cpu_init=False, pipeline=1).bias_activation_fusion
    assert not mm.transformer_config(arch, torch.float32, cpu_init=True, pipeline=1).bias_activation_fusion
    mlp = model.decoder.layers[0].mlp
    assert not mlp.config.bias_activation_fusion
    x = torch.randn(7, 2, arch.hidden_size, generator=torch.Generator().manual_seed(0))
    got = {}
    try:
        for fused in (False, True):
            mlp.config.bias_activation_fusion = fused
            mlp.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            out, _ = mlp(xi)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            got[fused] = [out.detach(), xi.grad] + [p.grad.clone() for p in mlp.parameters()]
    finally:
        mlp.config.bias_activation_fusion = False
        mlp.zero_grad(set_to_none=True)
    assert len(fused_calls) == 1  # the fused path ran once, the unfused one did not call it
    assert len(got[True]) == len(got[False]) >= 4
    for a, b in zip(got[True], got[False], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
