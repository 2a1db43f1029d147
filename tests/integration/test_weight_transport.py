"""The weight transport on real gloo groups and real shared memory: a sender and receivers in threads."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from async_rl.weight_sync.base import CorruptUpdate, SendProgress, SyncAborted, UpdateReceipt
from async_rl.weight_sync.bucketing import build_manifest
from async_rl.weight_sync.gloo import GlooChannel, abort_membership
from async_rl.weight_sync.shm import SHM_DIR
from async_rl.weight_sync.transport import join_receiver, join_sender, open_membership

pytestmark = pytest.mark.integration


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 16, generator=g),
        "layer.0.qkv.weight": torch.randn(48, 16, generator=g),
        "layer.0.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "layer.0.mlp.weight": torch.randn(64, 16, generator=g),
        "step": torch.tensor([7], dtype=torch.int64),
    }


def run_update(
    backend, receivers, state, versions=(1,), wire=None, tamper=None, send_version=None, checksum="full",
    bucket_bytes=4096, adopt=False, between=None, keep_going=False,
):
    """Send `state` once per version to `receivers` threads; returns what each receiver loaded.
    `adopt` moves the sender's tensors into the channel first; `between(v)` runs before sending v."""
    manifest = build_manifest(state.items(), bucket_bytes=bucket_bytes, wire_dtype=wire)
    assert len(manifest.buckets) > 1
    info, store = open_membership("127.0.0.1", 0, receivers + 1, 30, backend, manifest, checksum, 1)

    def receiver(rank):
        rx = join_receiver(info, rank, manifest)
        if tamper is not None:
            tamper(rx)
        loaded: list[dict[str, torch.Tensor]] = []
        receipts: list[UpdateReceipt] = []
        for v in versions:
            got: dict[str, torch.Tensor] = {}
            try:
                receipts.append(rx.receive(v, lambda it, got=got: got.update((n, t.clone()) for n, t in it)))
            except CorruptUpdate as e:
                if not keep_going:
                    raise
                receipts.append(e)  # refused; the protocol still ended cleanly, so take the next one
            loaded.append(got)
        return loaded, receipts

    with ThreadPoolExecutor(receivers) as pool:
        futures = [pool.submit(receiver, r) for r in range(1, receivers + 1)]
        sender = join_sender(info, store, manifest)
        if adopt:
            assert sender.adopt(state) == len(state)
        sent = []
        for v in versions:
            if between is not None:
                between(v)
            sent.append(sender.send(state, send_version if send_version is not None else v))
        results = [f.result(timeout=60) for f in futures]
    return info, sent, results


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_receivers_get_the_senders_weights_bit_exact(backend):
    state = model_state()
    info, sent, results = run_update(backend, 2, state, versions=(1, 2))
    for loaded, receipts in results:
        for got, receipt, ours in zip(loaded, receipts, sent, strict=True):
            assert got.keys() == state.keys()
            for name, t in state.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
            assert receipt.checksum == ours.checksum and receipt.manifest_digest == ours.manifest_digest
            assert receipt.version == ours.version
    if backend == "shm":
        # The shared file is unlinked once every receiver mapped it: nothing is left in /dev/shm.
        assert not os.path.exists(info.shm_path)
        assert info.shm_path.startswith(SHM_DIR)


def test_wire_cast_to_bfloat16():
    state = model_state()
    _, _, results = run_update("gloo", 1, state, wire=torch.bfloat16)
    got = results[0][0][0]
    for name, t in state.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("checksum", ["full", "sampled"])
def test_corrupted_bucket_is_detected(backend, checksum):
    def flip_a_byte_in_bucket_1(rx):
        channel = rx.channel
        original = channel.post_receive

        def post_receive(k, nbytes):
            buf, pending = original(k, nbytes)

            seen = torch.empty_like(buf)  # what this receiver read; never write into a shared region

            class Corrupting:
                def wait(self, timeout=None):
                    pending.wait(timeout)
                    seen.copy_(buf)
                    if k == 1:
                        seen[3] ^= 0xFF  # one flipped byte, as a faulty link or a torn write would do

            return seen, Corrupting()

        channel.post_receive = post_receive

    with pytest.raises(CorruptUpdate, match="checksum mismatch"):
        # Buckets of 4 KiB are one chunk each: 'sampled' checks every bucket's last chunk too.
        run_update(backend, 1, model_state(), tamper=flip_a_byte_in_bucket_1, checksum=checksum)


def big_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"layer.{i}.weight": torch.randn(1 << 19, generator=g) for i in range(6)}  # 2 MiB each


@pytest.mark.parametrize("checksum", ["full", "sampled", "off"])
def test_checksum_modes_hash_what_they_promise(checksum):
    # 12 MiB in 4 MiB buckets: 3 buckets of 4 chunks. 'full' hashes all 12 on both sides; 'sampled'
    # the same chunks on both sides: the 3 last ones and rarely more.
    _, sent, results = run_update("shm", 1, big_state(), versions=(1, 2), checksum=checksum, bucket_bytes=4 << 20)
    receipts = results[0][1]
    if checksum == "off":
        assert all(r.checksum == "" and r.chunks_checked == 0 for r in [*sent, *receipts])
        return
    assert all(r.checksum == s.checksum != "" for r, s in zip(receipts, sent, strict=True))
    assert [r.chunks_checked for r in receipts] == [s.chunks_checked for s in sent]
    if checksum == "full":
        assert all(r.chunks_checked == 12 for r in receipts)
    else:
        assert all(3 <= r.chunks_checked < 12 for r in receipts)


def test_sampled_checksum_catches_a_flip_only_in_the_chunks_it_checks():
    def flip_first_mib(rx):
        original = rx.channel.post_receive

        def post_receive(k, nbytes):
            buf, pending = original(k, nbytes)

            seen = torch.empty_like(buf)

            class Corrupting:
                def wait(self, timeout=None):
                    pending.wait(timeout)
                    seen.copy_(buf)
                    seen[10] ^= 0x01  # chunk 0 of every bucket: never a bucket's last chunk here

            return seen, Corrupting()

        rx.channel.post_receive = post_receive

    with pytest.raises(CorruptUpdate, match="checksum mismatch"):
        run_update("gloo", 1, big_state(), tamper=flip_first_mib, checksum="full", bucket_bytes=4 << 20)
    # 'sampled' misses it in one update unless its random pick includes a first chunk (3 buckets at
    # 1/32 each: p ~ 0.09), but a persistent fault is found over updates: 150 miss it all with p < 1e-6.
    _, _, results = run_update("gloo", 1, big_state(), versions=tuple(range(1, 151)), tamper=flip_first_mib,
                               checksum="sampled", bucket_bytes=4 << 20, keep_going=True)
    refused = [r for r in results[0][1] if isinstance(r, CorruptUpdate)]
    assert refused and all("checksum mismatch" in str(e) for e in refused)


def test_adopted_sender_tensors_live_in_the_mapping_and_updates_follow_them():
    state = model_state()
    state["layer.0.norm.weight"] = state["layer.0.norm.weight"].float()  # no wire cast: all adoptable
    originals = {n: t.clone() for n, t in state.items()}

    def train_a_step(v):
        if v == 2:
            for t in state.values():
                t.add_(1)  # in place, as an optimizer does: the next update must carry it

    info, sent, results = run_update("shm", 2, state, versions=(1, 2), adopt=True, between=train_a_step)
    for loaded, receipts in results:
        for name, t in originals.items():
            assert torch.equal(loaded[0][name], t), name
            assert torch.equal(loaded[1][name], t + 1), name
        assert [r.checksum for r in receipts] == [s.checksum for s in sent]


def test_sender_reports_each_bucket_as_it_moves():
    state = model_state()
    manifest = build_manifest(state.items(), bucket_bytes=4096)
    info, store = open_membership("127.0.0.1", 0, 2, 30, "gloo", manifest, "sampled", 1)
    seen: list[SendProgress] = []
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(lambda: join_receiver(info, 1, manifest).receive(3, lambda it: list(it)))
        sender = join_sender(info, store, manifest, on_bucket=[seen.append])
        sender.send(state, 3)
        received.result(timeout=60)
    n = len(manifest.buckets)
    assert n > 1 and seen == [SendProgress(3, k, n) for k in range(n + 1)]
    assert sender.progress == SendProgress(3, n, n)


def test_update_of_another_version_is_rejected():
    with pytest.raises(CorruptUpdate, match="version 5, expected 1"):
        run_update("gloo", 1, model_state(), send_version=5)


def test_gloo_channel_double_buffers():
    class NoGroup:
        pass

    channel = GlooChannel(NoGroup(), max_bucket_bytes=128)
    a, b, c = (channel.staging(k, 64) for k in range(3))
    assert a.data_ptr() != b.data_ptr() and a.data_ptr() == c.data_ptr()


def _receiver_that_dies(info, rank, manifest, ready):
    """A receiver process that joins, then is SIGKILLed once the first bucket of the update landed."""
    rx = join_receiver(info, rank, manifest)
    ready.set()

    def die(named):
        next(iter(named))
        os.kill(os.getpid(), signal.SIGKILL)

    rx.receive(1, die)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_dead_receiver_fails_the_update_for_everyone_within_seconds(backend):
    # The group's timeout is 40 s; a member dying mid-update must cost the others far less. Two paths
    # give that, as in a run: gloo sees the dead member's connection drop (whoever notices sets the
    # abort for the others), and the pool, whose call on the dead engine fails, aborts the membership
    # (GeneratorPool._gather). The watcher below plays the pool. Gloo alone usually wins within a
    # second; once in CI neither survivor heard of the death from gloo before its 40 s timeout, which
    # in a run the pool's abort covers. (The abandoned gloo group is destroyed at interpreter exit once
    # its posted operation timed out, so a longer timeout only delays the exit of the test process.)
    state = big_state()
    manifest = build_manifest(state.items(), bucket_bytes=1 << 20)
    info, store = open_membership("127.0.0.1", 0, 3, 40, backend, manifest, "sampled", 1)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    victim = ctx.Process(target=_receiver_that_dies, args=(info, 2, manifest, ready))
    victim.start()
    died_at: list[float] = []

    def pool_watch():
        victim.join(60)
        died_at.append(time.monotonic())
        abort_membership(info, "engine 2 died")

    def survivor():
        rx = join_receiver(info, 1, manifest)
        with pytest.raises(SyncAborted) as aborted:
            rx.receive(1, lambda it: [t.sum() for _, t in it])
        return time.monotonic(), str(aborted.value)

    with ThreadPoolExecutor(2) as pool:
        survived = pool.submit(survivor)
        sender = join_sender(info, store, manifest)
        assert ready.wait(60)
        pool.submit(pool_watch)
        with pytest.raises(SyncAborted) as aborted:
            sender.send(state, 1)
        sender_end, sender_reason = time.monotonic(), str(aborted.value)
        survivor_end, survivor_reason = survived.result(timeout=60)
    assert victim.exitcode == -signal.SIGKILL
    print(f"sender: {sender_reason}\nsurvivor: {survivor_reason}")  # which path told each (shown with -s)
    sender_s, survivor_s = sender_end - died_at[0], survivor_end - died_at[0]
    assert sender_s < 10 and survivor_s < 10, (sender_s, survivor_s, sender_reason, survivor_reason)


def test_controller_abort_frees_a_sender_waiting_for_a_member_that_never_joins():
    manifest = build_manifest(model_state().items(), bucket_bytes=4096)
    info, store = open_membership("127.0.0.1", 0, 2, 120, "gloo", manifest, "sampled", 1)
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(join_sender, info, store, manifest)
        time.sleep(0.5)  # the sender is waiting for rank 1, which died before it joined
        assert not joining.done()
        t0 = time.monotonic()
        abort_membership(info, "engine 3 died")
        with pytest.raises(SyncAborted, match="engine 3 died"):
            joining.result(timeout=30)
    assert time.monotonic() - t0 < 5


# ---- weight_sync.delta: updates as patches against the version every receiver holds --------------------


def run_delta(backend, receivers, steps, tamper=None, full_at=()):
    """A membership with delta on: the sender sends `steps[v-1]` as version v (fp32 state, bf16 wire);
    `tamper(rank, rx, v)` runs on each receiver before it takes version v; versions in `full_at` are
    sent full. Returns the sender's receipts and, per receiver, (loaded tensors or the refusal) per version."""
    manifest = build_manifest(steps[0].items(), bucket_bytes=4096, wire_dtype=torch.bfloat16)
    info, store = open_membership("127.0.0.1", 0, receivers + 1, 30, backend, manifest, "full", 1, delta=True)

    def receiver(rank):
        rx = join_receiver(info, rank, manifest)
        out = []
        for v in range(1, len(steps) + 1):
            if tamper is not None:
                tamper(rank, rx, v)
            got: dict[str, torch.Tensor] = {}
            try:
                receipt = rx.receive(v, lambda it, got=got: got.update((n, t.clone()) for n, t in it))
                out.append((got, receipt))
            except CorruptUpdate as e:
                out.append((None, e))
        return out

    with ThreadPoolExecutor(receivers) as pool:
        futures = [pool.submit(receiver, r) for r in range(1, receivers + 1)]
        sender = join_sender(info, store, manifest)
        sent = [sender.send(state, v, full=v in full_at) for v, state in enumerate(steps, start=1)]
        results = [f.result(timeout=60) for f in futures]
    return sent, results


def optimizer_like_steps(n: int) -> list[dict[str, torch.Tensor]]:
    """fp32 states as an optimizer leaves them: each step moves every element by ~1e-3 (most bf16 values stay)."""
    states = [model_state()]
    g = torch.Generator().manual_seed(5)
    for _ in range(n - 1):
        prev = states[-1]
        states.append({k: (t + 1e-3 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t + 1)
                       for k, t in prev.items()})
    return states


def bf16(state):
    return {k: (t.to(torch.bfloat16) if t.is_floating_point() else t) for k, t in state.items()}


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_delta_updates_leave_receivers_holding_the_senders_bf16_weights_bit_for_bit(backend):
    steps = optimizer_like_steps(4)
    sent, results = run_delta(backend, 2, steps)
    assert [r.delta for r in sent] == [False, True, True, True]  # the membership's first update is full
    full_bytes = sent[0].sent_bytes
    assert all(r.sent_bytes < full_bytes for r in sent[1:])
    for per_version in results:
        for (got, receipt), ours, state in zip(per_version, sent, steps, strict=True):
            assert got is not None, receipt
            assert receipt.delta == ours.delta and receipt.checksum == ours.checksum and receipt.sent_bytes == ours.sent_bytes
            want = bf16(state)
            assert got.keys() == want.keys()
            for name, t in want.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_a_receiver_that_missed_a_version_refuses_the_delta_and_takes_the_full_update():
    steps = optimizer_like_steps(4)

    def miss_v3(rank, rx, v):
        if rank == 2 and v == 3:
            rx.base_version = 1  # as if v2 never reached this worker's baseline

    sent, results = run_delta("gloo", 2, steps, tamper=miss_v3, full_at=(4,))
    assert [r.delta for r in sent] == [False, True, True, False]
    (got3, refusal) = results[1][2]
    assert got3 is None and isinstance(refusal, CorruptUpdate)
    assert "delta from v2, but this worker holds v1: it needs a full update" in str(refusal)
    assert results[0][2][0] is not None  # the other receiver took v3 as a delta
    for per_version in results:  # after the full update both hold v4 exactly
        got, receipt = per_version[3]
        assert not receipt.delta
        for name, t in bf16(steps[3]).items():
            assert torch.equal(got[name], t), name


def test_after_a_refused_delta_the_next_delta_is_refused_too_until_a_full_update():
    steps = optimizer_like_steps(3)

    def corrupt_v2(rank, rx, v):
        if v == 2:
            rx.base_version = 99

    _, results = run_delta("shm", 1, steps, tamper=corrupt_v2)
    assert isinstance(results[0][1][1], CorruptUpdate)
    # the refusal left this worker without a baseline: v3, a delta from v2, is refused as well
    assert isinstance(results[0][2][1], CorruptUpdate) and "holds no baseline" in str(results[0][2][1])


def test_delta_on_a_cuda_backend_is_refused_in_one_line():
    manifest = build_manifest(model_state().items(), bucket_bytes=4096)
    with pytest.raises(ValueError, match=r"weight_sync.delta=on: the nccl backend sends full updates only"):
        open_membership("127.0.0.1", 0, 2, 30, "nccl", manifest, "full", 1, delta=True)
