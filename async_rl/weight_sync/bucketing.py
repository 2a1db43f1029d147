"""Pack named tensors into fixed-size contiguous byte buckets, described by a manifest.

The manifest (names, shapes, dtypes, offsets) is sent once per group membership over the control
plane; each update then moves only raw bucket bytes. Offsets are aligned so every tensor can be
viewed in place inside its bucket.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Iterable

import msgspec
import numpy as np
import torch
import xxhash

_ALIGN = 64


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    name: str
    shape: list[int]
    dtype: str  # torch dtype name without the 'torch.' prefix, e.g. 'float32'
    offset: int  # bytes from the start of the bucket
    nbytes: int


class Bucket(msgspec.Struct, array_like=True, frozen=True):
    nbytes: int
    tensors: list[TensorSpec]


class Manifest(msgspec.Struct, frozen=True):
    buckets: list[Bucket]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.tensors) for b in self.buckets)

    def digest_bytes(self) -> bytes:
        return hashlib.blake2b(msgspec.msgpack.encode(self), digest_size=16).digest()

    def digest(self) -> str:
        return self.digest_bytes().hex()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype '{name}' in weight manifest")
    return dtype


def build_manifest(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, wire_dtype: torch.dtype | None = None
) -> Manifest:
    """Greedy packing in the given order; a tensor larger than `bucket_bytes` gets a bucket of its own.

    `wire_dtype` casts floating-point tensors on the wire (e.g. an fp32 learner to bf16 generators)."""
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    used = 0
    for name, t in named:
        dtype = wire_dtype if wire_dtype is not None and t.is_floating_point() else t.dtype
        nbytes = t.numel() * dtype.itemsize
        start = -(-used // _ALIGN) * _ALIGN
        if current and start + nbytes > bucket_bytes:
            buckets.append(Bucket(nbytes=used, tensors=current))
            current, used, start = [], 0, 0
        current.append(TensorSpec(name, list(t.shape), dtype_name(dtype), start, nbytes))
        used = start + nbytes
    if current:
        buckets.append(Bucket(nbytes=used, tensors=current))
    return Manifest(buckets=buckets)


def pack(bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors into `out` (uint8, at least bucket.nbytes); returns the used slice."""
    buf = out[: bucket.nbytes]
    for spec in bucket.tensors:
        t = tensors[spec.name].detach()
        dst = buf[spec.offset : spec.offset + spec.nbytes].view(to_dtype(spec.dtype)).view(t.shape)
        if dst.data_ptr() != t.data_ptr():  # a tensor already living in its slot needs no copy
            dst.copy_(t)  # casts when the wire dtype differs
    return buf


def unpack(bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into `buf` (uint8), one per tensor, with the manifest's shape and dtype."""
    return [
        (
            spec.name,
            buf[spec.offset : spec.offset + spec.nbytes].view(to_dtype(spec.dtype)).view(spec.shape),
        )
        for spec in bucket.tensors
    ]


CHUNK_BYTES = 1 << 20  # granularity of the update checksum: one xxh3-64 per MiB of every bucket
CHECKSUM_MODES = ("full", "sampled", "off")
SAMPLE_ONE_IN = 32  # 'sampled': ~1/32 of the chunks are hashed, chosen anew for every update


def chunk_counts(manifest: Manifest) -> list[int]:
    """Chunks per bucket (the last chunk of a bucket may be short)."""
    return [max(1, -(-b.nbytes // CHUNK_BYTES)) for b in manifest.buckets]


def _hash_chunk(buf: torch.Tensor, j: int) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(buf[j * CHUNK_BYTES : (j + 1) * CHUNK_BYTES].cpu().numpy()))


# The device hash of a chunk (a CUDA bucket is hashed where it is, no copy to the host): the chunk's
# little-endian int16 words w_i weighted by fixed pseudo-random coefficients c_i in [1, 2^27),
# H = sum_i w_i * c_i, exact in int64 (|w_i c_i| < 2^42, 2^19 words: |H| < 2^61), so any device and
# the CPU compute the same value whatever the summation order. Any change of one word changes H
# (c_i != 0); several changed words cancel only if their weighted differences sum to zero, which
# random coefficients make vanishingly unlikely for corruption that does not know them. It is not
# xxh3: both ends of a channel must hash alike, and they do, since a channel's buckets live on the
# same kind of device at both ends (CUDA for nccl and cuda_ipc, the host for gloo and shm).
_WORDS_PER_CHUNK = CHUNK_BYTES // 2
_COEFFICIENT_SEED = 0x30A5EED
_ROWS_PER_PASS = 16  # chunks hashed per kernel pass: an int64 temporary of 64 MiB at most


@functools.cache
def hash_coefficients(device: torch.device) -> torch.Tensor:
    """The device hash's c_i (the same on every device: drawn on the CPU from a fixed seed)."""
    g = torch.Generator().manual_seed(_COEFFICIENT_SEED)
    return torch.randint(1, 1 << 27, (_WORDS_PER_CHUNK,), generator=g, dtype=torch.int64).to(device)


def _weighted_words(words: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    x = words.to(torch.int64)
    x.mul_(coefficients[: x.shape[-1]])
    return x.sum(dim=-1)


def device_chunk_hashes(buf: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """The device hashes of chunks `chunks` (ascending) of bucket `buf` (uint8, on any device): an
    int64 tensor on `buf`'s device, one value per chunk, in order. Only launches kernels (runs of
    consecutive chunks are sliced, never indexed by a host list): nothing waits for the device."""
    coefficients = hash_coefficients(buf.device)
    full = buf.numel() // CHUNK_BYTES  # whole chunks; a last short chunk is hashed on its own
    rows = buf[: full * CHUNK_BYTES].view(full, CHUNK_BYTES)
    out = torch.empty(len(chunks), dtype=torch.int64, device=buf.device)
    i = 0
    while i < len(chunks):
        j = chunks[i]
        if j >= full:  # the short last chunk: an odd length gets a zero byte, to whole words
            tail = buf[j * CHUNK_BYTES :]
            if tail.numel() % 2:
                tail = torch.cat([tail, tail.new_zeros(1)])
            out[i] = _weighted_words(tail.view(torch.int16), coefficients)
            i += 1
            continue
        n = 1
        while n < _ROWS_PER_PASS and i + n < len(chunks) and chunks[i + n] == j + n and j + n < full:
            n += 1
        out[i : i + n] = _weighted_words(rows[j : j + n].view(torch.int16), coefficients)
        i += n
    return out


class ChunkTable:
    """The sender's checksum of an update: one xxh3-64 per chunk (MiB) of every bucket it hashed
    (0 for the others); it travels in the trailer.

    xxh3 runs at memory speed (~10 GB/s from DRAM here), as long as the copy it guards, and on 2
    cores the sender's hashing and the receivers' loads share the memory bandwidth: hashing every
    byte doubled a shared-memory update (measured, benchmarks/results/weight_sync.md). So 'full'
    hashes every chunk on both sides, and the default 'sampled' hashes, on both sides, the last
    chunk of every bucket (a short or misplaced bucket changes it) plus a random 1/32 of the rest,
    chosen from a seed the sender draws for each update and sends in the header: a systematic
    corruption (stale region, reordered or truncated buckets, wrong dtype) is caught at once, a
    random one over updates."""

    def __init__(self, manifest: Manifest) -> None:
        self.counts = chunk_counts(manifest)
        self.starts = [sum(self.counts[:k]) for k in range(len(self.counts))]
        self.hashes = [0] * sum(self.counts)

    @property
    def nbytes(self) -> int:
        return 8 * len(self.hashes)

    def fill(self, checker: ChunkChecker) -> None:
        """Take the hashes the sender's checker computed."""
        for (k, j), h in checker.seen.items():
            self.hashes[self.starts[k] + j] = h

    def to_bytes(self) -> bytes:
        return np.array(self.hashes, dtype=np.uint64).tobytes()

    @classmethod
    def from_bytes(cls, manifest: Manifest, raw: bytes) -> ChunkTable:
        table = cls(manifest)
        if len(raw) != table.nbytes:
            raise ValueError(f"checksum table of {len(raw)} bytes, expected {table.nbytes}")
        table.hashes = np.frombuffer(raw, dtype=np.uint64).tolist()
        return table

    def digest(self) -> str:
        """One name for the whole update (the receipt's checksum): xxh3-128 of the table."""
        return xxhash.xxh3_128_hexdigest(self.to_bytes())


class ChunkChecker:
    """Hash the chosen chunks of each bucket as it goes by. The sender and every receiver build one
    from the same seed, so they choose the same chunks; receivers compare with the sender's table.

    A bucket on the host is hashed with xxh3; a CUDA bucket on its device (`device_chunk_hashes`, no
    copy to the host per bucket: the hashes stay on the device until the update's table is needed,
    then come over in one small copy). `device_hash` forces one or the other (tests)."""

    def __init__(
        self, manifest: Manifest, mode: str, rng: random.Random | None = None, device_hash: bool | None = None
    ) -> None:
        self.counts = chunk_counts(manifest)
        self.mode = mode
        self.rng = rng or random.Random()
        self.device_hash = device_hash
        self._seen: dict[tuple[int, int], int] = {}
        self._on_device: list[tuple[int, list[int], torch.Tensor]] = []  # (bucket, chunks, their hashes)

    def chosen(self, k: int) -> list[int]:
        n = self.counts[k]
        if self.mode == "full":
            return list(range(n))
        return [j for j in range(n - 1) if self.rng.randrange(SAMPLE_ONE_IN) == 0] + [n - 1]

    def hash_bucket(self, k: int, buf: torch.Tensor) -> None:
        chunks = self.chosen(k)
        if buf.is_cuda if self.device_hash is None else self.device_hash:
            self._on_device.append((k, chunks, device_chunk_hashes(buf, chunks)))
            return
        for j in chunks:
            self._seen[(k, j)] = _hash_chunk(buf, j)

    @property
    def seen(self) -> dict[tuple[int, int], int]:
        """(bucket, chunk) -> hash of every chunk hashed so far (waits for the device's hashes)."""
        if self._on_device:  # one copy to the host for the whole update
            values = iter(torch.cat([hashes for _, _, hashes in self._on_device]).tolist())
            for k, chunks, _ in self._on_device:
                for j in chunks:
                    self._seen[(k, j)] = next(values) & 0xFFFF_FFFF_FFFF_FFFF  # the table holds uint64
            self._on_device = []
        return self._seen

    def bad_chunks(self, table: ChunkTable) -> list[tuple[int, int]]:
        return [(k, j) for (k, j), h in self.seen.items() if table.hashes[table.starts[k] + j] != h]

    @property
    def chunks_checked(self) -> int:
        return len(self._seen) + sum(len(chunks) for _, chunks, _ in self._on_device)
