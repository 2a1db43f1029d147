"""HF <-> Megatron weight conversion as pure tensor code: no megatron-core needed. Tensor-parallel
ranks are simulated in one process (shard for rank r of T, then gather)."""

from __future__ import annotations

import pytest
import torch

from async_rl.errors import ConfigError
from async_rl.learner.megatron import convert as mcv
from async_rl.learner.megatron.model import hf_param_shapes
from tests.unit._megatron_models import tiny_llama, tiny_qwen2, tiny_qwen2_moe, tiny_qwen3_moe

MODELS = {"qwen2": tiny_qwen2, "llama": tiny_llama, "llama-tied": lambda: tiny_llama(tie=True)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def hf_model(request):
    return MODELS[request.param]()


def test_arch_reads_the_hf_config(hf_model):
    arch = mcv.arch_from_hf_config(hf_model.config)
    cfg = hf_model.config
    assert arch.model_type == cfg.model_type
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.hidden_size // cfg.num_attention_heads,
    )
    assert arch.qkv_bias == (cfg.model_type == "qwen2")
    assert arch.tie_embeddings == cfg.tie_word_embeddings
    assert arch.rope_theta == (500000.0 if cfg.model_type == "llama" else cfg.rope_parameters["rope_theta"])


def test_unsupported_models_are_refused_with_the_reason():
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        mcv.arch_from_hf_config(GPT2Config())
    yarn = LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048})
    with pytest.raises(ConfigError, match="rope scaling"):
        mcv.arch_from_hf_config(yarn)
    llama3 = LlamaConfig(
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}
    )
    assert mcv.arch_from_hf_config(llama3).rope_scaling_factor == 32.0


def test_qkv_layout_is_per_query_group():
    """Label every row by (projection, head) and check Megatron's order: per group, its query heads,
    then its key head, then its value head."""
    arch = mcv.arch_from_hf_config(tiny_llama().config)  # 8 query heads, 4 groups, head_dim 16
    hd, h = arch.head_dim, arch.hidden_size

    def labelled(code: int, heads: int) -> torch.Tensor:
        return torch.cat([torch.full((hd, h), float(code * 100 + i)) for i in range(heads)])

    q, k, v = labelled(1, arch.num_heads), labelled(2, arch.num_kv_heads), labelled(3, arch.num_kv_heads)
    qkv = mcv.merge_qkv(q, k, v, arch)
    order = [int(qkv[r * hd, 0]) for r in range(qkv.shape[0] // hd)]
    assert order == [100, 101, 200, 300, 102, 103, 201, 301, 104, 105, 202, 302, 106, 107, 203, 303]
    for a, b in zip(mcv.split_qkv(qkv, arch), (q, k, v), strict=True):
        assert torch.equal(a, b)
    bias = mcv.merge_qkv(q[:, 0], k[:, 0], v[:, 0], arch)
    assert torch.equal(bias, qkv[:, 0])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_then_gather_is_the_identity_on_every_parameter(hf_model, tp):
    arch = mcv.arch_from_hf_config(hf_model.config)
    hf = dict(hf_model.named_parameters())
    full = mcv.hf_to_megatron_full(hf, arch, tp, 1, 0)
    for name, t in full.items():
        kind = mcv.shard_kind(name)
        parts = [mcv.shard(t, kind, r, tp) for r in range(tp)]
        if kind is not mcv.ShardKind.REPLICATED:
            assert all(p.numel() * tp == t.numel() for p in parts), name
        assert torch.equal(mcv.gather(parts, kind), t), name


def test_tensor_parallel_shards_hold_whole_groups_and_matching_gate_up_rows():
    model = tiny_llama()
    arch = mcv.arch_from_hf_config(model.config)
    hf = dict(model.named_parameters())
    full = mcv.hf_to_megatron_full(hf, arch, 2, 1, 0)
    layer = "decoder.layers.0."
    # rank 1 of 2 holds query groups 2..3: query heads 4..7 and key/value heads 2..3
    qkv1 = mcv.shard(full[layer + "self_attention.linear_qkv.weight"], mcv.ShardKind.ROWS, 1, 2)
    half = mcv.HFArch(**{**mcv.msgspec.structs.asdict(arch), "num_heads": 4, "num_kv_heads": 2})
    q1, k1, v1 = mcv.split_qkv(qkv1, half)
    hd = arch.head_dim
    assert torch.equal(q1, hf["model.layers.0.self_attn.q_proj.weight"][4 * hd :])
    assert torch.equal(k1, hf["model.layers.0.self_attn.k_proj.weight"][2 * hd :])
    assert torch.equal(v1, hf["model.layers.0.self_attn.v_proj.weight"][2 * hd :])
    fc1 = mcv.shard(full[layer + "mlp.linear_fc1.weight"], mcv.ShardKind.GATED_ROWS, 1, 2)
    ffn = arch.ffn_hidden_size
    assert torch.equal(fc1[: ffn // 2], hf["model.layers.0.mlp.gate_proj.weight"][ffn // 2 :])
    assert torch.equal(fc1[ffn // 2 :], hf["model.layers.0.mlp.up_proj.weight"][ffn // 2 :])
    proj = mcv.shard(full[layer + "self_attention.linear_proj.weight"], mcv.ShardKind.COLUMNS, 1, 2)
    assert torch.equal(proj, hf["model.layers.0.self_attn.o_proj.weight"][:, 64:])


@pytest.mark.parametrize("te_spec", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 2), (1, 2)])
def test_hf_to_megatron_to_hf_is_exact(hf_model, tp, pp, te_spec):
    """HF -> per-stage Megatron -> TP shards -> gather -> HF gives back every tensor bit for bit,
    under the names (and in the order) of the HF model's named_parameters()."""
    arch = mcv.arch_from_hf_config(hf_model.config)
    if arch.num_layers % pp:
        pytest.skip("layers not divisible")
    hf = dict(hf_model.named_parameters())
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        full = mcv.hf_to_megatron_full(hf, arch, tp, pp, stage, te_spec)
        if te_spec:
            assert not any("layernorm.weight" in n and "final" not in n for n in full)
        shards = [{n: mcv.shard(t, mcv.shard_kind(n), r, tp) for n, t in full.items()} for r in range(tp)]
        gathered = {n: mcv.gather([s[n] for s in shards], mcv.shard_kind(n)) for n in full}
        assert hf_param_shapes(arch, pp, stage) == {n: tuple(t.shape) for n, t in
                                                    mcv.megatron_full_to_hf(gathered, arch, pp, stage, te_spec)}
        back.update(mcv.megatron_full_to_hf(gathered, arch, pp, stage, te_spec))
    assert list(back) == list(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_tied_embeddings_have_no_output_layer_on_one_stage_and_a_copy_on_the_last_of_several():
    model = tiny_llama(tie=True)
    arch = mcv.arch_from_hf_config(model.config)
    hf = dict(model.named_parameters())
    assert "output_layer.weight" not in mcv.hf_to_megatron_full(hf, arch, 1, 1, 0)
    last = mcv.hf_to_megatron_full(hf, arch, 2, 2, 1)
    assert torch.equal(last["output_layer.weight"][:50], hf["model.embed_tokens.weight"])
    assert torch.count_nonzero(last["output_layer.weight"][50:]) == 0  # padding rows
    assert "embedding.word_embeddings.weight" not in last


def test_parallel_layout_errors_name_the_field():
    arch = mcv.arch_from_hf_config(tiny_llama().config)
    with pytest.raises(ConfigError, match="tensor_parallel_size=8 does not divide the model's num_key_value_heads=4"):
        mcv.check_parallel_layout(arch, 8, 1)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=3"):
        mcv.check_parallel_layout(arch, 1, 3)
    with pytest.raises(ValueError, match="no tensor-parallel rule"):
        mcv.shard_kind("decoder.layers.0.self_attention.q_layernorm.bias")


@pytest.mark.parametrize("te_spec", [False, True])
@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("model", [tiny_qwen3_moe, tiny_qwen2_moe])
def test_experts_over_expert_parallel_ranks_come_back_exactly(model, ep, te_spec):
    """HF -> full Megatron -> each EP rank's local experts (megatron's local names, or TE's grouped
    `linear_fc1.weight{j}`) -> global names -> HF: every tensor bit for bit, in the HF model's order;
    each rank holds E/EP experts, the others' none."""
    hf_model = model()
    arch = mcv.arch_from_hf_config(hf_model.config)
    hf = dict(hf_model.named_parameters())
    full = mcv.hf_to_megatron_full(hf, arch, 1, 1, 0, te_spec)
    back: dict[str, torch.Tensor] = {}
    for rank in range(ep):
        local = mcv.expert_shard(full, arch, ep, rank, te_spec)
        experts = [n for n in local if mcv.is_expert(n)]
        assert len(experts) == 2 * arch.num_layers * arch.num_experts // ep
        assert all(("local_experts" not in n) == te_spec for n in experts)
        back.update({mcv.expert_global_name(n, arch, ep, rank) if mcv.is_expert(n) else n: t for n, t in local.items()})
    assert set(back) == set(full)
    assert mcv.shard_kind("decoder.layers.0.mlp.experts.linear_fc1.weight3") is mcv.ShardKind.GATED_ROWS
    assert mcv.shard_kind("decoder.layers.0.mlp.router.weight") is mcv.ShardKind.REPLICATED
    out = dict(mcv.megatron_full_to_hf(back, arch, 1, 0, te_spec))
    assert list(out) == list(hf)
    assert all(torch.equal(out[n], t) for n, t in hf.items())
    assert hf_param_shapes(arch, 1, 0) == {n: tuple(t.shape) for n, t in hf.items()}
