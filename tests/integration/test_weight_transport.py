"""The weight transport on real gloo groups and real shared memory: a sender and receivers in threads."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from async_rl.weight_sync.base import CorruptUpdate, UpdateReceipt
from async_rl.weight_sync.bucketing import build_manifest
from async_rl.weight_sync.gloo import GlooChannel
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


def run_update(backend, receivers, state, versions=(1,), wire=None, tamper=None, send_version=None):
    """Send `state` once per version to `receivers` threads; returns what each receiver loaded."""
    manifest = build_manifest(state.items(), bucket_bytes=4096, wire_dtype=wire)
    assert len(manifest.buckets) > 1
    info, store = open_membership("127.0.0.1", 0, receivers + 1, 30, backend, manifest, True, 1)

    def receiver(rank):
        rx = join_receiver(info, rank, manifest)
        if tamper is not None:
            tamper(rx)
        loaded: list[dict[str, torch.Tensor]] = []
        receipts: list[UpdateReceipt] = []
        for v in versions:
            got: dict[str, torch.Tensor] = {}
            receipts.append(rx.receive(v, lambda it, got=got: got.update((n, t.clone()) for n, t in it)))
            loaded.append(got)
        return loaded, receipts

    with ThreadPoolExecutor(receivers) as pool:
        futures = [pool.submit(receiver, r) for r in range(1, receivers + 1)]
        sender = join_sender(info, store, manifest)
        sent = [sender.send(state, send_version if send_version is not None else v) for v in versions]
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
def test_corrupted_bucket_is_detected(backend):
    def flip_a_byte_in_bucket_1(rx):
        channel = rx.channel
        original = channel.post_receive

        def post_receive(k, nbytes):
            buf, pending = original(k, nbytes)

            class Corrupting:
                def wait(self):
                    pending.wait()
                    if k == 1:
                        buf[3] ^= 0xFF  # one flipped byte, as a faulty link or a torn write would do

            return buf, Corrupting()

        channel.post_receive = post_receive

    with pytest.raises(CorruptUpdate, match="checksum mismatch"):
        run_update(backend, 1, model_state(), tamper=flip_a_byte_in_bucket_1)


def test_update_of_another_version_is_rejected():
    with pytest.raises(CorruptUpdate, match="version 5, expected 1"):
        run_update("gloo", 1, model_state(), send_version=5)


def test_gloo_channel_double_buffers():
    class NoGroup:
        pass

    channel = GlooChannel(NoGroup(), max_bucket_bytes=128)
    a, b, c = (channel.staging(k, 64) for k in range(3))
    assert a.data_ptr() != b.data_ptr() and a.data_ptr() == c.data_ptr()
