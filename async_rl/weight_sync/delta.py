"""Delta updates: per bucket, only the elements whose value on the wire (the engines' dtype) changed
since the version every receiver holds.

Both ends keep a baseline: the wire-dtype tensors of the last update that every member of the
membership loaded (the sender's copy of what it last sent; each receiver's copy of what it last
received). An update's plan says, per tensor of the manifest, how it travels:

    SAME   nothing: the baseline is unchanged
    INDEX  n int32 flat indices, then their n values            6n bytes for bf16
    MASK   a bitmask of numel bits (little bit order), then the n values
    DENSE  every element, as in a full update

The smallest of the four is chosen per tensor; a tensor is never larger than in a full update, and
its 64-byte aligned start is never later than there, so a delta bucket always fits the full bucket's
slot (shm). Changes are found bitwise (not by value): -0.0 vs 0.0 and NaN payloads are changes too,
so a receiver's baseline ends bit for bit equal to the sender's.
"""

from __future__ import annotations

import numpy as np
import torch

from async_rl.weight_sync.bucketing import Bucket, Manifest, to_dtype

SAME, INDEX, MASK, DENSE = 0, 1, 2, 3
KIND_NAMES = ("same", "index", "mask", "dense")
_ALIGN = 64
MIN_BUCKET_BYTES = 8  # an unchanged bucket still moves (a few bytes): every channel op has a buffer
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encoded_bytes(kind: int, numel: int, changed: int, itemsize: int) -> int:
    """Bytes of one tensor's patch (internal padding included)."""
    if kind == SAME:
        return 0
    if kind == DENSE:
        return numel * itemsize
    if kind == INDEX:
        return _aligned(4 * changed) + changed * itemsize
    return _aligned(-(-numel // 8)) + changed * itemsize  # MASK


def choose(numel: int, changed: int, itemsize: int) -> int:
    """The smallest encoding of a tensor with `changed` of `numel` elements changed; DENSE unless a
    sparse one is strictly smaller (so a delta bucket never outgrows the full one)."""
    if changed == 0:
        return SAME
    best, best_bytes = DENSE, numel * itemsize
    for kind in (INDEX, MASK):
        if kind == INDEX and numel >= 1 << 31:
            continue  # int32 indices
        size = encoded_bytes(kind, numel, changed, itemsize)
        if size < best_bytes:
            best, best_bytes = kind, size
    return best


def plan_nbytes(manifest: Manifest) -> int:
    """The plan travels as int64 (kind, changed) per tensor, in manifest order."""
    return 16 * manifest.num_tensors


def bucket_sizes(manifest: Manifest, plan: np.ndarray) -> list[int]:
    """Each delta bucket's size, from the plan (int64 [num_tensors, 2])."""
    sizes, i = [], 0
    for bucket in manifest.buckets:
        used = 0
        for spec in bucket.tensors:
            kind, changed = int(plan[i, 0]), int(plan[i, 1])
            i += 1
            itemsize = to_dtype(spec.dtype).itemsize
            n = encoded_bytes(kind, spec.nbytes // itemsize, changed, itemsize)
            if n:
                used = _aligned(used) + n
        sizes.append(max(used, MIN_BUCKET_BYTES))
    return sizes


def delta_manifest(manifest: Manifest, sizes: list[int]) -> Manifest:
    """The update's buckets as the checksum sees them (sizes only)."""
    return Manifest(buckets=[Bucket(nbytes=n, tensors=[]) for n in sizes])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width: equality is bitwise."""
    return t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def diff_bucket(bucket: Bucket, new: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> list[tuple[int, int, torch.Tensor]]:
    """(kind, changed, mask) per tensor of the bucket: `new` (wire dtype) against the baseline."""
    out = []
    for spec in bucket.tensors:
        mask = _bits(new[spec.name]) != _bits(base[spec.name])
        changed = int(mask.count_nonzero())  # a bool sum() is ~15x slower on the CPU
        itemsize = to_dtype(spec.dtype).itemsize
        out.append((choose(spec.nbytes // itemsize, changed, itemsize), changed, mask))
    return out


def write_bucket(
    bucket: Bucket, diffs: list[tuple[int, int, torch.Tensor]], new: dict[str, torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    """Pack the bucket's patches into `out` (uint8); returns the used slice. Same layout as
    `bucket_sizes` computes."""
    used = 0
    for spec, (kind, changed, mask) in zip(bucket.tensors, diffs, strict=True):
        if kind == SAME:
            continue
        start = _aligned(used)
        flat = new[spec.name].reshape(-1)
        itemsize = flat.element_size()
        if kind == DENSE:
            out[start : start + spec.nbytes].view(flat.dtype).copy_(flat)
            used = start + spec.nbytes
            continue
        # numpy's flatnonzero and an index gather: torch's nonzero and boolean indexing are ~2x and
        # ~8x slower on the CPU (measured, 20M elements, one thread)
        idx = torch.from_numpy(np.flatnonzero(mask.numpy()))
        if kind == INDEX:
            head = _aligned(4 * changed)
            out[start : start + 4 * changed].view(torch.int32).copy_(idx)
        else:
            nbits = -(-mask.numel() // 8)
            head = _aligned(nbits)
            packed = np.packbits(mask.numpy(), bitorder="little")
            out[start : start + nbits].copy_(torch.from_numpy(packed))
        values = out[start + head : start + head + changed * itemsize].view(flat.dtype)
        torch.index_select(flat, 0, idx, out=values)
        used = start + head + changed * itemsize
    n = max(used, MIN_BUCKET_BYTES)
    if used < n:
        out[used:n].zero_()
    return out[:n]


def apply_bucket(bucket: Bucket, plan: np.ndarray, first: int, buf: torch.Tensor, base: dict[str, torch.Tensor]) -> None:
    """Apply bucket's patches (plan rows from `first`) to the baseline tensors, in place."""
    used = 0
    for i, spec in enumerate(bucket.tensors, start=first):
        kind, changed = int(plan[i, 0]), int(plan[i, 1])
        if kind == SAME:
            continue
        flat = base[spec.name].reshape(-1)
        start = _aligned(used)
        itemsize = flat.element_size()
        if kind == DENSE:
            flat.copy_(buf[start : start + spec.nbytes].view(flat.dtype))
            used = start + spec.nbytes
            continue
        if kind == INDEX:
            head = _aligned(4 * changed)
            where = buf[start : start + 4 * changed].view(torch.int32).numpy()
            if changed and (int(where.min()) < 0 or int(where.max()) >= flat.numel()):
                raise ValueError(f"delta patch of '{spec.name}': an index outside its {flat.numel()} elements")
        elif kind == MASK:
            nbits = -(-flat.numel() // 8)
            head = _aligned(nbits)
            bits = np.unpackbits(buf[start : start + nbits].numpy(), count=flat.numel(), bitorder="little")
            where = np.flatnonzero(bits)
            if where.size != changed:
                raise ValueError(f"delta patch of '{spec.name}': its mask marks {where.size} elements, the plan {changed}")
        else:
            raise ValueError(f"delta plan: unknown kind {kind} for '{spec.name}'")
        values = buf[start + head : start + head + changed * itemsize]
        # as same-width integers in numpy (no bf16 there): a fancy-index put, ~8x faster than a torch bool put
        word = _INT_OF_SIZE[itemsize]
        flat.view(word).numpy()[where] = values.view(word).numpy()
        used = start + head + changed * itemsize


def baseline_like(manifest: Manifest) -> dict[str, torch.Tensor]:
    """Empty baseline tensors in the manifest's wire dtypes and shapes."""
    return {
        spec.name: torch.empty(spec.shape, dtype=to_dtype(spec.dtype))
        for bucket in manifest.buckets
        for spec in bucket.tensors
    }
