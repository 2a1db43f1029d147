"""The upcycling behind the `smollm2-135m-moe` preset (models/upcycle.py), on a tiny random Llama of the
base's depth: every expert is the base MLP plus noise of PERTURBATION x its std, the experts differ from
each other, everything else is the base's exactly, the routing is what the launcher knows before the
model is built, and the upcycled model computes almost what the base does."""

from __future__ import annotations

import shutil

import pytest
import torch

from async_rl.models import upcycle
from async_rl.models.moe import read_routing

VOCAB = 64


def tiny_llama(folder, layers: int, tokenizer_from):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(folder)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    for f in tokenizer_from.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    return model


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory, model_dir):
    base_dir, out = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("moe")
    base = tiny_llama(base_dir, upcycle.BASE_LAYERS, model_dir)
    upcycle.upcycle(base_dir, out)
    from transformers import AutoModelForCausalLM

    return base, AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), out


def test_each_expert_is_the_base_mlp_plus_a_little_noise(upcycled):
    base, moe, _ = upcycled
    for layer, (b, m) in enumerate(zip(base.model.layers, moe.model.layers, strict=True)):
        pairs = [(torch.cat([b.mlp.gate_proj.weight, b.mlp.up_proj.weight]), m.mlp.experts.gate_up_proj),
                 (b.mlp.down_proj.weight, m.mlp.experts.down_proj)]
        for want, experts in pairs:
            assert experts.shape[0] == upcycle.EXPERTS
            for e in range(upcycle.EXPERTS):
                noise = float((experts[e] - want).std() / want.std())
                assert noise == pytest.approx(upcycle.PERTURBATION, rel=0.2), (layer, e)
            assert not torch.equal(experts[0], experts[1])  # routing matters: the experts are not one copy
        assert m.mlp.gate.weight.shape == (upcycle.EXPERTS, base.config.hidden_size)


def test_everything_but_the_mlps_is_the_base_model(upcycled):
    base, moe, _ = upcycled
    theirs = moe.state_dict()
    kept = {k: v for k, v in base.state_dict().items() if ".mlp." not in k}
    assert kept and all(torch.equal(v, theirs[k]) for k, v in kept.items())


def test_the_routing_is_the_one_known_before_the_build_and_the_model_computes_almost_the_base(upcycled):
    base, moe, out = upcycled
    assert read_routing(out) == upcycle.routing()
    assert (moe.config.num_local_experts, moe.config.num_experts_per_tok) == (upcycle.EXPERTS, upcycle.TOP_K)
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = torch.log_softmax(base(input_ids=ids).logits, -1)
        b = torch.log_softmax(moe(input_ids=ids).logits, -1)
    # the chosen experts' weights sum to 1 (renormalised top-k) and each is near the base MLP
    assert (a - b).abs().max() < 0.05, float((a - b).abs().max())


def test_a_base_of_another_depth_is_refused_in_one_line(tmp_path, model_dir):
    tiny_llama(tmp_path / "base", 2, model_dir)
    with pytest.raises(RuntimeError, match=r"^smollm2-135m-moe: the base model has 2 layers, not 30$"):
        upcycle.upcycle(tmp_path / "base", tmp_path / "out")
