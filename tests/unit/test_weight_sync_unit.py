"""Bucketing (manifest, pack, unpack) and the order-independent parameter checksum. No groups, no sockets."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from async_rl.weight_sync.bucketing import (
    CHUNK_BYTES,
    Bucket,
    ChunkChecker,
    ChunkTable,
    Manifest,
    TensorSpec,
    build_manifest,
    device_chunk_hashes,
    dtype_name,
    hash_coefficients,
    pack,
    to_dtype,
    unpack,
)
from async_rl.weight_sync.checksum import ParamChecksum, checksum_of


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(10, generator=g)),  # float32, 40 B
        ("b", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 B
        ("c", torch.randint(-(2**40), 2**40, (4,), generator=g, dtype=torch.int64)),  # 32 B
        ("d", torch.randn(100, generator=g)),  # 400 B, larger than a bucket
        ("e", torch.randn(2, 3, generator=g)),  # 24 B
        ("f", torch.tensor(-(2**62) + 7, dtype=torch.int64)),  # a 0-d scalar, 8 B
    ]


def test_build_manifest_hand_layout():
    m = build_manifest(named_tensors(), bucket_bytes=128)
    # a@0 (40 B), b@64 (30 B) -> 94 B; c would start at 128 > 128 - 32: new bucket
    # c@0; d (400 B) does not fit: alone in its own bucket; e@0, f@64
    assert m == Manifest(
        buckets=[
            Bucket(94, [TensorSpec("a", [10], "float32", 0, 40), TensorSpec("b", [3, 5], "bfloat16", 64, 30)]),
            Bucket(32, [TensorSpec("c", [4], "int64", 0, 32)]),
            Bucket(400, [TensorSpec("d", [100], "float32", 0, 400)]),
            Bucket(72, [TensorSpec("e", [2, 3], "float32", 0, 24), TensorSpec("f", [], "int64", 64, 8)]),
        ]
    )
    assert m.num_tensors == 6
    assert m.total_bytes == 94 + 32 + 400 + 72


@pytest.mark.parametrize("bucket_bytes", [64, 100, 128, 512, 4096])
def test_manifest_buckets_respect_size_and_alignment(bucket_bytes):
    g = torch.Generator().manual_seed(1)
    named = [(f"t{i}", torch.randn(int(torch.randint(1, 60, (1,), generator=g)), generator=g)) for i in range(40)]
    m = build_manifest(named, bucket_bytes)
    specs = [s for b in m.buckets for s in b.tensors]
    assert [s.name for s in specs] == [n for n, _ in named]  # order kept, nothing lost
    for b in m.buckets:
        assert b.tensors
        if len(b.tensors) > 1:
            assert b.nbytes <= bucket_bytes
        else:
            assert b.nbytes == b.tensors[0].nbytes  # a lone tensor may exceed the size only by itself
        end = 0
        for s in b.tensors:
            assert s.offset % 64 == 0
            assert s.offset >= end  # no overlap
            end = s.offset + s.nbytes
        assert b.nbytes == end
    for (_, t), s in zip(named, specs, strict=True):
        assert s.nbytes == t.numel() * 4
        assert s.shape == list(t.shape)


def test_every_bucket_larger_than_size_holds_one_tensor():
    named = [("big1", torch.zeros(50)), ("small", torch.zeros(2)), ("big2", torch.zeros(50)), ("big3", torch.zeros(33))]
    m = build_manifest(named, bucket_bytes=128)
    assert [[s.name for s in b.tensors] for b in m.buckets] == [["big1"], ["small"], ["big2"], ["big3"]]
    assert [b.nbytes for b in m.buckets] == [200, 8, 200, 132]


def test_empty_manifest():
    m = build_manifest([], bucket_bytes=64)
    assert m.buckets == [] and m.total_bytes == 0 and m.num_tensors == 0


def test_pack_unpack_bit_exact_mixed_dtypes_and_shapes():
    named = named_tensors()
    src = dict(named)
    m = build_manifest(named, bucket_bytes=128)
    staging = torch.full((max(b.nbytes for b in m.buckets) + 16,), 0xAB, dtype=torch.uint8)
    got: dict[str, torch.Tensor] = {}
    for bucket in m.buckets:
        buf = pack(bucket, src, staging)
        assert buf.dtype == torch.uint8 and buf.numel() == bucket.nbytes
        received = buf.clone()  # what a receiver's broadcast buffer would hold
        for name, t in unpack(bucket, received):
            got[name] = t
    assert list(got) == [n for n, _ in named]
    for name, want in named:
        t = got[name]
        assert t.dtype == want.dtype, name
        assert t.shape == want.shape, name
        assert torch.equal(t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    assert got["f"].item() == -(2**62) + 7
    assert got["c"].tolist() == src["c"].tolist()


def test_unpack_returns_views_into_the_buffer():
    named = [("x", torch.arange(4, dtype=torch.float32)), ("y", torch.arange(3, dtype=torch.int64))]
    m = build_manifest(named, bucket_bytes=1024)
    (bucket,) = m.buckets
    buf = pack(bucket, dict(named), torch.zeros(bucket.nbytes, dtype=torch.uint8)).clone()
    views = dict(unpack(bucket, buf))
    assert views["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert views["y"].tolist() == [0, 1, 2]
    buf[64:72].copy_(torch.tensor([9], dtype=torch.int64).view(torch.uint8))
    assert views["y"].tolist() == [9, 1, 2]  # in place: no copy on the receiving side


def test_pack_non_contiguous_source():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tr = base.t()  # [4, 3], not contiguous
    assert not tr.is_contiguous()
    m = build_manifest([("w", tr)], bucket_bytes=1024)
    buf = pack(m.buckets[0], {"w": tr}, torch.empty(m.buckets[0].nbytes, dtype=torch.uint8))
    ((name, out),) = unpack(m.buckets[0], buf.clone())
    assert name == "w"
    assert out.shape == (4, 3)
    assert torch.equal(out, tr)


def test_pack_leaves_gaps_alone_and_uses_only_bucket_bytes():
    named = [("x", torch.ones(1)), ("y", torch.ones(1))]
    m = build_manifest(named, bucket_bytes=1024)
    out = torch.full((200,), 7, dtype=torch.uint8)
    buf = pack(m.buckets[0], dict(named), out)
    assert buf.numel() == 68
    assert out[68:].eq(7).all()  # nothing written past the bucket


def test_manifest_digest_changes_when_a_shape_changes():
    a = build_manifest([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))], 1024)
    same = build_manifest([("w", torch.ones(2, 3)), ("b", torch.ones(3))], 1024)
    reshaped = build_manifest([("w", torch.zeros(3, 2)), ("b", torch.zeros(3))], 1024)
    renamed = build_manifest([("v", torch.zeros(2, 3)), ("b", torch.zeros(3))], 1024)
    retyped = build_manifest([("w", torch.zeros(2, 3, dtype=torch.int32)), ("b", torch.zeros(3))], 1024)
    assert a.digest() == same.digest()  # the digest covers the layout, not the values
    assert len(a.digest()) == 32
    assert len({a.digest(), reshaped.digest(), renamed.digest(), retyped.digest()}) == 4


def test_manifest_survives_msgpack():
    m = build_manifest(named_tensors(), 128)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=Manifest)
    assert back == m
    assert back.digest() == m.digest()


def test_dtype_names():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool):
        assert to_dtype(dtype_name(dt)) is dt
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="nope"):
        to_dtype("nope")
    with pytest.raises(ValueError):
        to_dtype("nn")  # an attribute of torch that is not a dtype


def chunked_manifest() -> Manifest:
    # bucket 0: 2.5 MiB (3 chunks, the last short), bucket 1: 1 MiB (1 chunk)
    return build_manifest([("a", torch.zeros(5 << 17)), ("b", torch.zeros(1 << 18))], bucket_bytes=3 << 20)


def test_chunk_table_hashes_every_mib_and_round_trips():
    manifest = chunked_manifest()
    assert [b.nbytes for b in manifest.buckets] == [5 << 19, 1 << 20]
    table = ChunkTable(manifest)
    assert table.counts == [3, 1] and table.nbytes == 32
    bufs = [torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8) for b in manifest.buckets]
    sender = ChunkChecker(manifest, "full")
    for k, buf in enumerate(bufs):
        sender.hash_bucket(k, buf)
    table.fill(sender)
    assert all(table.hashes)
    back = ChunkTable.from_bytes(manifest, table.to_bytes())
    assert back.hashes == table.hashes and back.digest() == table.digest()
    checker = ChunkChecker(manifest, "full")
    for k, buf in enumerate(bufs):
        checker.hash_bucket(k, buf)
    assert checker.chunks_checked == 4 and checker.bad_chunks(table) == []
    bufs[0][2 * CHUNK_BYTES + 5] ^= 1  # one bit in the short last chunk of bucket 0
    checker = ChunkChecker(manifest, "full")
    for k, buf in enumerate(bufs):
        checker.hash_bucket(k, buf)
    assert checker.bad_chunks(table) == [(0, 2)]


def reference_device_hash(chunk: bytes) -> int:
    """The device hash written out with numpy: int16 words (a zero byte pads an odd length) weighted by
    the same coefficients, summed exactly."""
    words = np.frombuffer(chunk + bytes(len(chunk) % 2), dtype="<i2").astype(np.int64)
    coefficients = hash_coefficients(torch.device("cpu"))[: len(words)].numpy()
    return int(np.dot(words, coefficients))


def test_device_chunk_hash_on_cpu_tensors_is_the_exact_weighted_word_sum():
    # the same kernels run on CUDA; integer sums below 2^63 do not depend on the device or the order
    buf = torch.randint(0, 256, (2 * CHUNK_BYTES + 12345,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    hashes = device_chunk_hashes(buf, [2, 0, 1]).tolist()
    raw = buf.numpy().tobytes()
    want = [reference_device_hash(raw[j * CHUNK_BYTES : (j + 1) * CHUNK_BYTES]) for j in (2, 0, 1)]
    assert hashes == want and len(set(hashes)) == 3
    # extreme words cannot overflow: every byte 0xFF (word -1) and 0x80 (the most negative word)
    for fill in (0xFF, 0x80):
        full = torch.full((CHUNK_BYTES,), fill, dtype=torch.uint8)
        assert device_chunk_hashes(full, [0]).tolist() == [reference_device_hash(bytes([fill]) * CHUNK_BYTES)]


def test_device_chunk_hash_changes_with_any_flipped_byte_and_with_swapped_words():
    buf = torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    clean = device_chunk_hashes(buf, [0]).item()
    for at in (0, 1, 777, CHUNK_BYTES // 2, CHUNK_BYTES - 1):
        bad = buf.clone()
        bad[at] ^= 0x01
        assert device_chunk_hashes(bad, [0]).item() != clean, at
    swapped = buf.clone()
    swapped[0:2], swapped[2:4] = buf[2:4].clone(), buf[0:2].clone()
    assert bool((swapped != buf).any()) and device_chunk_hashes(swapped, [0]).item() != clean


def test_device_hashed_checker_finds_the_corrupted_chunk():
    manifest = chunked_manifest()
    bufs = [torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8) for b in manifest.buckets]
    table = ChunkTable(manifest)
    sender = ChunkChecker(manifest, "full", device_hash=True)
    for k, buf in enumerate(bufs):
        sender.hash_bucket(k, buf)
    assert sender.chunks_checked == 4
    table.fill(sender)
    receiver = ChunkChecker(manifest, "full", device_hash=True)
    for k, buf in enumerate(bufs):
        receiver.hash_bucket(k, buf)
    assert receiver.bad_chunks(table) == []
    bufs[0][2 * CHUNK_BYTES + 5] ^= 1  # one bit in the short last chunk of bucket 0
    receiver = ChunkChecker(manifest, "full", device_hash=True)
    for k, buf in enumerate(bufs):
        receiver.hash_bucket(k, buf)
    assert receiver.bad_chunks(table) == [(0, 2)]
    # a receiver hashing with xxh3 what the sender hashed on the device refuses rather than accepts
    host = ChunkChecker(manifest, "full", device_hash=False)
    bufs[0][2 * CHUNK_BYTES + 5] ^= 1
    for k, buf in enumerate(bufs):
        host.hash_bucket(k, buf)
    assert len(host.bad_chunks(table)) == 4


def test_chunk_table_of_wrong_size_is_refused():
    with pytest.raises(ValueError, match="checksum table of 8 bytes, expected 32"):
        ChunkTable.from_bytes(chunked_manifest(), bytes(8))


def test_sampled_checker_always_takes_each_buckets_last_chunk_and_about_1_in_32_of_the_rest():
    manifest = build_manifest([("w", torch.zeros(64 << 18))], bucket_bytes=64 << 20)  # 64 chunks
    checker = ChunkChecker(manifest, "sampled", rng=random.Random(0))
    picks = [checker.chosen(0) for _ in range(2000)]
    assert all(p[-1] == 63 for p in picks)
    others = sum(len(p) - 1 for p in picks) / (2000 * 63)
    assert 0.8 / 32 < others < 1.2 / 32
    assert ChunkChecker(manifest, "full").chosen(0) == list(range(64))
    # sender and receivers seeded alike choose alike (they hash the same chunks of an update)
    a, b = (ChunkChecker(manifest, "sampled", rng=random.Random(7)) for _ in range(2))
    assert [a.chosen(0) for _ in range(50)] == [b.chosen(0) for _ in range(50)]


# ---------------------------------------------------------------- ParamChecksum


def test_checksum_hand_values():
    cs = checksum_of([torch.tensor([1.0, -2.0]), torch.tensor([[3.0]])])
    assert cs == ParamChecksum(total=2.0, sum_sq=14.0, count=3)


def test_checksum_invariant_under_fusing_and_reordering():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(64, 32, generator=g) for _ in range(3))
    separate = checksum_of([q, k, v])
    fused = checksum_of([torch.cat([q, k, v], dim=0)])
    reordered = checksum_of([v, torch.cat([k, q], dim=1).t()])
    assert separate.count == fused.count == 3 * 64 * 32
    assert separate.close_to(fused) and fused.close_to(separate)
    assert separate.close_to(reordered)


def test_checksum_close_to_detects_one_element_change():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3 * 64 * 32, generator=g)
    changed = w.clone()
    changed[1234] += 1e-3
    assert not checksum_of([w]).close_to(checksum_of([changed]))
    flipped = w.clone()
    flipped[7] = -flipped[7]  # same sum of squares, different total
    assert not checksum_of([w]).close_to(checksum_of([flipped]))
    assert checksum_of([w]).close_to(checksum_of([w.clone()]))


def test_checksum_count_mismatch():
    assert not checksum_of([torch.zeros(3)]).close_to(checksum_of([torch.zeros(4)]))


def test_checksum_of_bfloat16_equals_its_float32_upcast():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(256, generator=g).to(torch.bfloat16)
    assert checksum_of([w]) == checksum_of([w.float()])
