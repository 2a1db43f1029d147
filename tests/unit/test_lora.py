"""learner.lora on the torch learner (PEFT): what trains, the reference, the wire, checkpoints, config."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from peft import get_peft_model_state_dict

from async_rl.config import AlgorithmConfig, LoraConfig
from async_rl.errors import ConfigError
from async_rl.learner.base import checkpoint_adapter_dir
from async_rl.learner.batch.cut import ONE_MICRO_BATCH
from async_rl.learner.batch.padded import PaddedShard
from async_rl.learner.driver import LearnerDriver
from async_rl.learner.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, served_tensors
from async_rl.learner.rl.reference import ReferencePolicy
from async_rl.weight_sync.bucketing import build_manifest
from async_rl.weight_sync.checksum import checksum_of
from async_rl.weight_sync.transport import join_receiver, join_sender, open_membership
from tests.unit._learner_fixtures import groups
from tests.unit._learner_fixtures import make_rank as make_rank_of

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)



def make_rank(model_dir, **overrides) -> LearnerDriver:
    return make_rank_of(model_dir, lora=LORA, **overrides)


def adapter_names(rank: LearnerDriver) -> set[str]:
    return {n for n, _ in rank.backend.model.named_parameters() if ".lora_" in n}


def test_only_adapter_parameters_get_gradients_and_optimizer_state(model_dir):
    rank = make_rank(model_dir)
    before = {n: p.detach().clone() for n, p in rank.backend.model.named_parameters()}
    names = adapter_names(rank)
    assert names and all(("lora_A" in n) or ("lora_B" in n) for n in names)
    rank.train_on_shard(0, groups(1))
    opt = rank.backend.optimizer
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    with_state = {id(p) for p in opt.state}
    for n, p in rank.backend.model.named_parameters():
        if n in names:
            assert p.requires_grad and id(p) in in_opt and id(p) in with_state, n
        else:
            assert not p.requires_grad and p.grad is None and id(p) not in in_opt, n
            assert torch.equal(p, before[n]), f"frozen base weight {n} changed"
    # the adapter did train: B leaves zero
    assert any(not torch.equal(p, before[n]) for n, p in rank.backend.model.named_parameters() if "lora_B" in n)


def test_reference_pass_is_the_base_model_with_the_adapter_disabled(model_dir):
    rank = make_rank(model_dir, algorithm=AlgorithmConfig(kl_coef=0.1))
    ref = rank.algo.reference
    assert ref.model is rank.backend.model  # no second copy of the weights
    with torch.no_grad():  # an adapter that changes the output
        for n, p in rank.backend.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    shard = PaddedShard(groups(3))
    loaded = ReferencePolicy(str(model_dir), torch.float32, cut=ONE_MICRO_BATCH)  # the base model, loaded on its own
    assert torch.equal(ref.score(shard, 1.0), loaded.score(shard, 1.0))
    # the same model with its adapter on scores differently (the comparison above can fail)
    with_adapter = ReferencePolicy.of_base(rank.backend.model, contextlib.nullcontext, cut=ONE_MICRO_BATCH)
    assert not torch.allclose(with_adapter.score(shard, 1.0), loaded.score(shard, 1.0))


def test_adapter_update_round_trips_through_the_wire_bit_exactly(model_dir):
    rank = make_rank(model_dir)
    rank.train_on_shard(0, groups(2))  # B no longer zero
    adapter = rank.backend.adapter()
    assert set(adapter.tensors) == set(get_peft_model_state_dict(rank.backend.peft))  # PEFT's (and vLLM's) names
    tensors = dict(adapter.tensors)
    manifest = build_manifest(tensors.items(), bucket_bytes=8192)
    assert len(manifest.buckets) > 1
    full = sum(p.numel() for p in rank.backend.model.parameters())
    assert manifest.total_bytes < 0.2 * full * 4  # the adapter alone goes on the wire
    info, store = open_membership("127.0.0.1", 0, 2, 30, "gloo", manifest, "full", 1)

    def receive():
        rx = join_receiver(info, 1, manifest)
        got = {}
        receipt = rx.receive(7, lambda it: got.update((n, t.clone()) for n, t in it))
        return got, receipt

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(receive)
        sent = join_sender(info, store, manifest).send(tensors, 7)
        got, receipt = fut.result(timeout=60)
    assert receipt.checksum == sent.checksum and receipt.version == 7
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t.detach()), name


def test_served_checksum_folds_the_scaling_into_b(model_dir):
    rank = make_rank(model_dir)
    rank.train_on_shard(0, groups(2))
    adapter = rank.backend.adapter()
    s = LORA.alpha / LORA.rank
    want = checksum_of(t.detach() * s if ".lora_B." in n else t.detach() for n, t in adapter.tensors.items())
    assert checksum_of(served_tensors(adapter.tensors, adapter.config)) == want
    assert rank.param_checksum() == want
    assert not want.close_to(checksum_of(t.detach() for t in adapter.tensors.values()))


def test_checkpoint_is_peft_format_and_resumes_bit_exactly(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    a = make_rank(model_dir)
    a.train_on_shard(0, groups(4))
    a.save_checkpoint(str(tmp_path))
    folder = checkpoint_adapter_dir(tmp_path)
    assert (folder / ADAPTER_WEIGHTS).is_file() and (folder / ADAPTER_CONFIG).is_file()
    assert not (tmp_path / "model").exists()  # no copy of the base weights
    # PEFT itself loads it onto the base model, with the learner's adapter values
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(folder))
    theirs = dict(peft.named_parameters())
    for name, p in a.backend.model.named_parameters():
        if ".lora_" in name:
            assert torch.equal(theirs["base_model.model." + name], p), name
    b = make_rank(model_dir)
    assert b.load_checkpoint(str(tmp_path)) == 1
    ma, mb = a.train_on_shard(1, groups(5)), b.train_on_shard(1, groups(5))
    assert ma.loss == mb.loss
    for (name, p), (_, q) in zip(a.backend.model.named_parameters(), b.backend.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_lora_with_megatron_is_refused_in_one_line():
    from async_rl.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["learner.backend=megatron", "learner.lora.enabled=true"])
    assert "learner.lora" in str(e.value) and "\n" not in str(e.value)


def test_merged_export_scores_like_the_adapter(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from async_rl.export_merged import export_merged

    rank = make_rank(model_dir)
    with torch.no_grad():  # a large adapter, so that a wrong merge shows
        for n, p in rank.backend.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    rank.save_checkpoint(str(tmp_path / "ckpt"))
    out = export_merged(tmp_path / "ckpt", tmp_path / "merged", base=model_dir)
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        want = torch.log_softmax(rank.backend.model(ids).logits, -1)
        got = torch.log_softmax(merged(ids).logits, -1)
        unmerged = torch.log_softmax(base(ids).logits, -1)
    assert (got - want).abs().mean() < 1e-5
    assert (unmerged - want).abs().mean() > 1e-3  # the adapter matters here
    assert not any(".lora_" in n for n, _ in merged.named_parameters())


# ---- a vision-language model: the adapter on its language model only -------------------------------

VL_LM = "model.language_model."  # the tiny Qwen2.5-VL's language model (its vision tower: model.visual.)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from async_rl.models.tiny import resolve_model_path

    return resolve_model_path("tiny-qwen2.5-vl", str(tmp_path_factory.mktemp("models")))


def make_vl_rank(vl_dir) -> LearnerDriver:
    from async_rl.config import VisionConfig

    return make_rank(vl_dir, vision=VisionConfig())


def test_a_vlm_adapter_is_on_its_language_model_only_and_is_sent_under_peft_names(vl_dir):
    rank = make_vl_rank(vl_dir)
    model = rank.backend.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = adapter_names(rank)
    layers = int(model.config.get_text_config().num_hidden_layers)
    # every target of every language-model layer, A and B; the ViT blocks' gate/up/down_proj get none
    assert len(names) == 2 * layers * len(LORA.target_modules)
    assert all(n.startswith(VL_LM + "layers.") for n in names), sorted(names)[:3]
    assert any(n.startswith("model.visual.blocks.") and n.endswith("mlp.gate_proj.weight") for n in before)
    # the base is frozen, the vision tower and its projector (the merger) included
    assert not [n for n, p in model.named_parameters() if p.requires_grad and n not in names]
    # the names a sync sends: PEFT's saved names, which vLLM maps with Qwen2.5-VL's hf_to_vllm_mapper
    # ('model.language_model.' -> 'language_model.model.')
    sent = sorted(rank.backend.adapter().tensors)
    assert sent[0] == "base_model.model.model.language_model.layers.0.mlp.down_proj.lora_A.weight", sent[0]
    assert all(s.startswith("base_model.model." + VL_LM) and ".default." not in s for s in sent)
    assert all(len(b.tensors) for b in rank.weight_manifest().buckets)
    assert {t.name for b in rank.weight_manifest().buckets for t in b.tensors} == set(sent)
    rank.train_on_shard(0, groups(1))
    for n, p in model.named_parameters():
        if n not in names:
            assert torch.equal(p, before[n]), f"frozen base weight {n} changed"
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if "lora_B" in n)


def test_a_vlm_adapter_checkpoint_resumes_and_merges_into_a_vlm_folder(vl_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from async_rl.export_merged import export_merged

    a = make_vl_rank(vl_dir)
    a.train_on_shard(0, groups(4))
    with torch.no_grad():  # a large adapter, so that a wrong merge shows
        for n, p in a.backend.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    a.save_checkpoint(str(tmp_path / "ckpt"))
    folder = checkpoint_adapter_dir(tmp_path / "ckpt")
    assert (folder / ADAPTER_WEIGHTS).is_file() and not (tmp_path / "ckpt" / "model").exists()
    b = make_vl_rank(vl_dir)
    b.load_checkpoint(str(tmp_path / "ckpt"))
    for (name, p), (_, q) in zip(a.backend.model.named_parameters(), b.backend.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    # PEFT loads the adapter onto the VLM (the target regex in adapter_config.json picks the same modules)
    peft = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(str(vl_dir)), str(folder))
    theirs = dict(peft.named_parameters())
    assert {n for n in theirs if ".lora_" in n} == {"base_model.model." + n for n in adapter_names(a)}
    # the merged export is a VLM folder transformers loads: its vision tower is the base's, its language
    # model scores like the learner's with the adapter
    out = export_merged(tmp_path / "ckpt", tmp_path / "merged", base=vl_dir)
    merged = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32)
    base = AutoModelForImageTextToText.from_pretrained(str(vl_dir), dtype=torch.float32)
    base_params = dict(base.named_parameters())
    for n, p in merged.named_parameters():
        if n.startswith("model.visual."):
            assert torch.equal(p, base_params[n]), n
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        want = torch.log_softmax(a.backend.model(input_ids=ids).logits, -1)
        got = torch.log_softmax(merged(input_ids=ids).logits, -1)
        unmerged = torch.log_softmax(base(input_ids=ids).logits, -1)
    assert (got - want).abs().mean() < 1e-5
    assert (unmerged - want).abs().mean() > 1e-3  # the adapter matters here


def test_lora_on_a_vlm_with_a_trained_vision_tower_is_refused_in_one_line():
    from async_rl.config import load_config
    from async_rl.vision_settings import vision_error

    cfg = load_config(None, ["model.path=tiny-qwen2.5-vl", "learner.lora.enabled=true"])
    assert vision_error(cfg, True) is None
    cfg = load_config(None, ["model.path=tiny-qwen2.5-vl", "learner.lora.enabled=true", "learner.freeze_vision=false"])
    why = vision_error(cfg, True)
    assert why and why.startswith("learner.freeze_vision=false:") and "\n" not in why
