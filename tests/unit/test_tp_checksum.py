"""The resume check with tensor-parallel engines, on CPU: two TP workers' vLLM layers hold the shards
vLLM's loaders would give them (fused QKV with a KV head replicated on both workers, merged gate/up,
row-parallel projections, padded vocabulary shards, replicated norms); each worker's checksum parts,
added up by the controller, equal the learner's checksum of the full HF weights. Worker 0 alone does
not, which is what the old check compared."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
import torch

from async_rl.control.controller import engine_checksums
from async_rl.errors import RunError
from async_rl.serving.worker_extension import loaded_weight_parts, shard_checksum
from async_rl.weight_sync.checksum import checksum_of

if TYPE_CHECKING:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbeddingShardIndices

# vLLM's layers are imported where the workers are built, not at collection: every pytest-xdist
# worker collects every module (collecting the suite: 14.5 CPU-s with it at module level, 12.6 without).

HIDDEN, HEADS, KV_HEADS, HEAD, FFN, VOCAB = 8, 4, 1, 2, 12, 10
PADDED_SHARD = 8  # each worker's vocabulary rows, padding included (5 real ones at TP=2)


def hf_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return {
        "embed_tokens.weight": r(VOCAB, HIDDEN),
        "q_proj.weight": r(HEADS * HEAD, HIDDEN),
        "k_proj.weight": r(KV_HEADS * HEAD, HIDDEN),
        "v_proj.weight": r(KV_HEADS * HEAD, HIDDEN),
        "q_proj.bias": r(HEADS * HEAD),
        "k_proj.bias": r(KV_HEADS * HEAD),
        "v_proj.bias": r(KV_HEADS * HEAD),
        "o_proj.weight": r(HIDDEN, HEADS * HEAD),
        "gate_proj.weight": r(FFN, HIDDEN),
        "up_proj.weight": r(FFN, HIDDEN),
        "down_proj.weight": r(HIDDEN, FFN),
        "down_proj.bias": r(HIDDEN),
        "norm.weight": r(HIDDEN),
        "lm_head.weight": r(VOCAB, HIDDEN),
    }


def layer(cls, **attrs):
    """A vLLM layer with the given attributes, without its constructor (which needs vLLM's parallel
    state): what the checksum reads is its class, its TP attributes and its parameters."""
    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    for k, v in attrs.items():
        if isinstance(v, torch.Tensor):
            m.register_parameter(k, torch.nn.Parameter(v.clone(), requires_grad=False))
        else:
            setattr(m, k, v)
    return m


def vocab_shard(full: torch.Tensor, rank: int, tp: int) -> tuple[torch.Tensor, VocabParallelEmbeddingShardIndices]:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbeddingShardIndices

    per = -(-VOCAB // tp)
    start, end = rank * per, min(VOCAB, (rank + 1) * per)
    rows = torch.full((PADDED_SHARD if tp > 1 else VOCAB + 6, HIDDEN), 1e3)  # padding rows hold junk
    rows[: end - start] = full[start:end]
    padded = rows.shape[0]
    idx = VocabParallelEmbeddingShardIndices(
        rank * padded, (rank + 1) * padded, 0, 0, start, end, 0, 0
    )
    return rows, idx


def tp_worker(w: dict[str, torch.Tensor], rank: int, tp: int) -> torch.nn.Module:
    """What TP worker `rank` of `tp` holds, laid out as vLLM's loaders lay it out."""
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    heads, kv_replicas = HEADS // tp, max(1, tp // KV_HEADS)
    kv = slice(0, HEAD) if tp >= KV_HEADS else slice(rank * KV_HEADS // tp * HEAD, (rank + 1) * KV_HEADS // tp * HEAD)
    q = slice(rank * heads * HEAD, (rank + 1) * heads * HEAD)
    f = slice(rank * FFN // tp, (rank + 1) * FFN // tp)
    embed, embed_idx = vocab_shard(w["embed_tokens.weight"], rank, tp)
    head, head_idx = vocab_shard(w["lm_head.weight"], rank, tp)
    common = {"tp_size": tp, "tp_rank": rank}
    model = torch.nn.Module()
    model.embed = layer(VocabParallelEmbedding, weight=embed, shard_indices=embed_idx, **common)
    model.qkv = layer(
        QKVParallelLinear,
        weight=torch.cat([w["q_proj.weight"][q], w["k_proj.weight"][kv], w["v_proj.weight"][kv]]),
        bias=torch.cat([w["q_proj.bias"][q], w["k_proj.bias"][kv], w["v_proj.bias"][kv]]),
        num_heads=heads,
        head_size=HEAD,
        num_kv_head_replicas=kv_replicas,
        **common,
    )
    model.o = layer(RowParallelLinear, weight=w["o_proj.weight"][:, q], **common)
    model.gate_up = layer(
        MergedColumnParallelLinear, weight=torch.cat([w["gate_proj.weight"][f], w["up_proj.weight"][f]]), **common
    )
    model.down = layer(RowParallelLinear, weight=w["down_proj.weight"][:, f], bias=w["down_proj.bias"], **common)
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(w["norm.weight"].clone(), requires_grad=False)
    model.lm_head = layer(ParallelLMHead, weight=head, shard_indices=head_idx, **common)
    return model


def engine_parts(w: dict[str, torch.Tensor], tp: int):
    return [shard_checksum(loaded_weight_parts(tp_worker(w, r, tp))) for r in range(tp)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_workers_parts_add_up_to_the_learners_full_weights(tp):
    w = hf_weights()
    learner = checksum_of(w.values())
    parts = engine_parts(w, tp)
    assert engine_checksums({0: parts})[0].close_to(learner)
    if tp > 1:  # what the old check compared: one worker's weights against the whole model
        whole_of_worker0 = checksum_of(t for t, _ in loaded_weight_parts(tp_worker(w, 0, tp)))
        assert not whole_of_worker0.close_to(learner)


def test_a_worker_with_another_shard_fails_the_check():
    w = hf_weights()
    parts = engine_parts(w, 2)
    other = dict(w)
    other["o_proj.weight"] = w["o_proj.weight"] + torch.eye(HIDDEN) * 1e-3  # worker 1's slice of it differs
    parts[1] = engine_parts(other, 2)[1]
    assert not engine_checksums({0: parts})[0].close_to(checksum_of(w.values()))


def test_workers_disagreeing_on_a_replicated_weight_is_a_one_line_error():
    w = hf_weights()
    other = dict(w)
    other["norm.weight"] = w["norm.weight"] * 2
    parts = [engine_parts(w, 2)[0], engine_parts(other, 2)[1]]
    with pytest.raises(RunError, match="engine 3: TP worker 1 holds other replicated weights") as info:
        engine_checksums({3: parts})
    assert "\n" not in str(info.value)


def test_weight_reload_runs_inside_vllms_config_context():
    """V2: the update loads through the worker's reload_weights (vLLM's own wrapper sets the config
    context), so a weight loader that reads get_current_vllm_config() works; the model runner's
    reload_weights called directly would run without it (and that call raises in vLLM 0.32)."""
    from vllm.config import VllmConfig, get_current_vllm_config
    from vllm.v1.worker.gpu_worker import Worker

    from async_rl.serving.worker_extension import WeightReceiverExtension
    from async_rl.weight_sync.base import UpdateReceipt

    seen = []

    class Runner:
        def reload_weights(self, weights_iterator, is_checkpoint_format):
            seen.append((get_current_vllm_config() is worker.vllm_config, [n for n, _ in weights_iterator]))

        def get_model(self):
            return torch.nn.Module()

    class Receiver:
        def receive(self, version, load):
            load(iter([("w", torch.zeros(1))]))
            return UpdateReceipt(version=version, manifest_digest="", checksum="", nbytes=4, seconds=0.0)

    class StubWorker(WeightReceiverExtension):
        reload_weights = Worker.reload_weights  # vLLM's, as the real worker class has it

    worker = StubWorker()
    worker.vllm_config = VllmConfig()
    # the receiver names experts by the served model's type (weight_sync/expert_names.py): a dense one here
    worker.vllm_config.model_config = SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen2"))
    worker.model_runner = Runner()
    worker._async_rl_receiver = Receiver()
    worker.async_rl_receive_weights(1)
    assert seen == [(True, ["w"])]
