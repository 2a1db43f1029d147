"""CUDA tensors through the bucketing path: pack on the GPU, unpack bit-exact (runs on a lent GPU)."""

from __future__ import annotations

import torch

from async_rl.weight_sync.bucketing import build_manifest, pack, unpack


def test_pack_unpack_cuda_bit_exact():
    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(64, 32, device="cuda"),
        "b.weight": torch.randn(7, device="cuda", dtype=torch.bfloat16),
        "c.bias": torch.randn(3, 5, device="cuda", dtype=torch.float16),
    }
    manifest = build_manifest(tensors.items(), bucket_bytes=4096)
    staging = torch.empty(max(b.nbytes for b in manifest.buckets), dtype=torch.uint8, device="cuda")
    for bucket in manifest.buckets:
        buf = pack(bucket, tensors, staging).clone()
        for name, view in unpack(bucket, buf):
            assert view.device.type == "cuda"
            assert torch.equal(view, tensors[name])
