"""weight_sync.delta: the patch format (weight_sync/delta.py), the served-checksum verdict after a delta
(weight_sync/verify.py) and the config's resolution of `auto` and refusals of `on`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.weight_sync import delta as dl
from async_rl.weight_sync.base import UpdateReceipt
from async_rl.weight_sync.bucketing import build_manifest
from async_rl.weight_sync.checksum import ShardChecksum, checksum_of
from async_rl.weight_sync.verify import delta_mismatches


def test_choose_picks_the_smallest_encoding_and_dense_on_ties():
    assert dl.choose(1000, 0, 2) == dl.SAME
    assert dl.choose(100_000, 10, 2) == dl.INDEX  # 64 + 20 bytes against 12,500 + 20 (mask) or 200,000
    assert dl.choose(100_000, 20_000, 2) == dl.MASK  # 12,544 + 40,000 against 120,000+ (index)
    assert dl.choose(100_000, 90_000, 2) == dl.MASK  # 12,544 + 180,000 is still below 200,000
    assert dl.choose(100_000, 95_000, 2) == dl.DENSE  # 12,544 + 190,000 is not
    assert dl.choose(4, 1, 2) == dl.DENSE  # a 64-byte aligned index block is larger than 8 bytes
    for numel, itemsize in ((10, 2), (1000, 2), (4096, 4), (33, 1)):
        for changed in range(0, numel + 1, max(1, numel // 50)):
            kind = dl.choose(numel, changed, itemsize)
            assert dl.encoded_bytes(kind, numel, changed, itemsize) <= numel * itemsize


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=g),
        "norm.weight": torch.randn(64, generator=g),
        "mlp.weight": torch.randn(128, 64, generator=g),
        "tiny.bias": torch.randn(3, generator=g),
        "step": torch.tensor([7], dtype=torch.int64),
    }


def _round_trip(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], wire=torch.bfloat16):
    """Encode `new` against `old` bucket by bucket and apply it to a copy of `old`: (patched, plan, sizes)."""
    manifest = build_manifest(new.items(), bucket_bytes=16_384, wire_dtype=wire)
    cast = {n: (t.to(wire) if t.is_floating_point() else t).contiguous() for n, t in new.items()}
    base_tx = {n: (t.to(wire) if t.is_floating_point() else t).clone() for n, t in old.items()}
    base_rx = {n: t.clone() for n, t in base_tx.items()}
    rows, sizes = [], []
    payloads = []
    for bucket in manifest.buckets:
        diffs = dl.diff_bucket(bucket, cast, base_tx)
        rows += [(k, c) for k, c, _ in diffs]
        out = torch.empty(bucket.nbytes + 64, dtype=torch.uint8)
        payloads.append(dl.write_bucket(bucket, diffs, cast, out).clone())
    plan = np.array(rows, dtype=np.int64)
    sizes = dl.bucket_sizes(manifest, plan)
    assert sizes == [p.numel() for p in payloads]
    first = 0
    for bucket, buf, size in zip(manifest.buckets, payloads, sizes, strict=True):
        assert size <= max(bucket.nbytes, dl.MIN_BUCKET_BYTES)  # a delta bucket fits the full bucket's slot
        dl.apply_bucket(bucket, plan, first, buf, base_rx)
        first += len(bucket.tensors)
    return base_rx, cast, plan, manifest


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.05, 0.3, 1.0])
def test_patches_rebuild_the_new_weights_bit_for_bit(fraction):
    old = _state(0)
    new = {n: t.clone() for n, t in old.items()}
    g = torch.Generator().manual_seed(1)
    for name in ("embed.weight", "norm.weight", "mlp.weight", "tiny.bias"):
        hit = torch.rand(new[name].shape, generator=g) < fraction
        new[name][hit] += 0.5  # a change bf16 sees
    patched, want, plan, _ = _round_trip(old, new)
    for name, t in want.items():
        assert torch.equal(patched[name].view(torch.uint8), t.view(torch.uint8)), name
    if fraction == 0.0:
        assert (plan[:, 0] == dl.SAME).all()
    if fraction == 1.0:
        assert (plan[plan[:, 1] > 0, 0] == dl.DENSE).all()


def test_sparse_and_dense_choices_follow_the_density():
    old = _state(0)
    new = {n: t.clone() for n, t in old.items()}
    new["embed.weight"].view(-1)[:5] += 1.0  # 5 of 19,200: indices
    new["mlp.weight"].view(-1)[::4] += 1.0  # a quarter: bitmask
    new["norm.weight"] += 1.0  # every element: dense
    _, _, plan, manifest = _round_trip(old, new)
    names = [s.name for b in manifest.buckets for s in b.tensors]
    kinds = {n: dl.KIND_NAMES[int(plan[i, 0])] for i, n in enumerate(names)}
    assert kinds == {"embed.weight": "index", "mlp.weight": "mask", "norm.weight": "dense", "tiny.bias": "same",
                     "step": "same"}


def test_changes_below_the_wire_precision_are_not_sent_and_signed_zero_is():
    old = {"w": torch.ones(1000), "z": torch.zeros(1000)}
    new = {"w": torch.ones(1000) + 1e-5, "z": torch.zeros(1000)}  # bf16 rounds 1 + 1e-5 to 1
    new["z"][3] = -0.0  # equal by value, another bf16 bit pattern: sent, so both ends stay bitwise equal
    patched, want, plan, _ = _round_trip(old, new)
    assert [tuple(r) for r in plan] == [(dl.SAME, 0), (dl.INDEX, 1)]
    assert torch.equal(patched["z"].view(torch.int16), want["z"].view(torch.int16))


def _receipt(delta=True, expected=None, parts=None) -> UpdateReceipt:
    return UpdateReceipt(version=3, manifest_digest="d", checksum="c", nbytes=10, seconds=0.1, delta=delta, sent_bytes=10,
                         expected=expected, served_parts=parts)


def test_delta_verdict_names_each_engine_serving_other_weights():
    w = [torch.randn(100), torch.randn(10)]
    learner = checksum_of(w)
    empty = checksum_of([])
    good = ShardChecksum(sharded=empty, replicated=learner)
    off = ShardChecksum(sharded=empty, replicated=checksum_of([w[0], w[1] + 2 ** -8]))
    ours = _receipt(expected=learner)
    engines = {0: [_receipt(parts=good)], 1: [_receipt(parts=off)], 2: [_receipt(parts=None)]}
    bad = delta_mismatches(ours, engines)
    assert set(bad) == {1, 2} and "served checksum" in bad[2]
    # TP 2: the workers' sharded parts add up to the learner's checksum
    halves = [ShardChecksum(sharded=checksum_of([w[0][:50]]), replicated=checksum_of([w[1]])),
              ShardChecksum(sharded=checksum_of([w[0][50:]]), replicated=checksum_of([w[1]]))]
    assert delta_mismatches(ours, {0: [_receipt(parts=p) for p in halves]}) == {}
    with pytest.raises(ValueError, match="no expected checksum"):
        delta_mismatches(_receipt(expected=None), engines)


def test_a_delta_served_wrong_falls_back_to_a_full_update_and_is_counted():
    from async_rl.weight_sync.verify import verified_update

    w = [torch.randn(100)]
    learner = checksum_of(w)
    right = ShardChecksum(sharded=checksum_of([]), replicated=learner)
    wrong = ShardChecksum(sharded=checksum_of([]), replicated=checksum_of([w[0] * 2]))
    calls: list[bool] = []
    told: list[str] = []

    def update(full: bool):
        calls.append(full)
        if full:
            return _receipt(delta=False), {0: [_receipt(delta=False)], 1: [_receipt(delta=False)]}
        return _receipt(expected=learner), {0: [_receipt(parts=right)], 1: [_receipt(parts=wrong)]}

    out = verified_update(update, 3, told.append)
    assert calls == [False, True] and out.fell_back and not out.delta
    assert out.sent_bytes == 20 and len(told) == 1 and "delta update v3: engine 1 serves" in told[0]

    calls.clear()
    right_only = lambda full: (_receipt(expected=learner), {0: [_receipt(parts=right)]})  # noqa: E731
    out = verified_update(right_only, 4, told.append)
    assert out.delta and not out.fell_back and len(told) == 1  # no fall-back, nothing counted


def _cfg(*overrides: str):
    from async_rl.config import load_config

    return load_config(None, ["generators.device=cpu", "learner.device=cpu", *overrides])


def test_delta_auto_is_on_for_bf16_engines_across_hosts_and_off_otherwise():
    from async_rl.control.settings import resolve_delta

    across = ("generators.dtype=bfloat16", "ray.address=10.0.0.1:6379")  # gloo to a Ray cluster (auto)
    assert resolve_delta(_cfg(*across)) == "on"
    # one host: measured slower than a full sync (shm, and gloo on one host), so off unless asked for
    assert resolve_delta(_cfg("generators.dtype=bfloat16")) == "off"
    assert resolve_delta(_cfg("generators.dtype=bfloat16", "weight_sync.backend=gloo")) == "off"
    assert resolve_delta(_cfg("generators.dtype=bfloat16", "weight_sync.delta=on")) == "on"
    assert resolve_delta(_cfg(*across, "generators.dtype=float32")) == "off"  # every element changes
    assert resolve_delta(_cfg("generators.dtype=float32")) == "off"  # every element changes
    assert resolve_delta(_cfg("generators.dtype=bfloat16", "learner.lora.enabled=true")) == "off"
    assert resolve_delta(_cfg("generators.dtype=bfloat16", "weight_sync.delta=off")) == "off"


@pytest.mark.parametrize(("overrides", "why"), [
    (["generators.dtype=float32"], "the engines hold the learner's precision"),
    (["generators.dtype=bfloat16", "learner.lora.enabled=true"], "learner.lora.enabled syncs the adapter alone"),
    (["generators.dtype=bfloat16", "weight_sync.backend=nccl"], "weight_sync.backend=nccl sends full updates only"),
])
def test_delta_on_where_it_cannot_work_is_one_line_naming_the_key(overrides, why):
    from async_rl.control.settings import resolve_delta
    from async_rl.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        resolve_delta(_cfg("weight_sync.delta=on", *overrides))
    line = str(err.value)
    assert line.startswith("weight_sync.delta=on: ") and why in line and "\n" not in line
