"""The NCCL (CuPy) weight channel on a real GPU. One GPU holds one NCCL rank: the full protocol runs
with the sender alone (world 1); a 2-rank broadcast runs where 2 GPUs are present."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from async_rl.weight_sync.base import SyncAborted
from async_rl.weight_sync.bucketing import build_manifest
from async_rl.weight_sync.gloo import abort_membership
from async_rl.weight_sync.transport import join_receiver, join_sender, open_membership

cupy = pytest.importorskip("cupy", reason="needs CuPy built for torch's CUDA (cupy-cuda13x, the gpu extra)")


def cuda_state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "embed.weight": torch.randn(256, 64, device="cuda", generator=g),
        "mlp.weight": torch.randn(128, 64, device="cuda", generator=g).to(torch.bfloat16),
    }


def test_sender_alone_runs_the_whole_protocol_on_cuda():
    state = cuda_state()
    manifest = build_manifest(state.items(), bucket_bytes=16384)
    info, store = open_membership("127.0.0.1", 0, 1, 60, "nccl", manifest, "sampled", 1)
    assert info.nccl_id
    sender = join_sender(info, store, manifest)
    receipt = sender.send(state, 3)
    assert receipt.version == 3 and receipt.checksum and receipt.nbytes == manifest.total_bytes


def _receive(info, manifest, out):
    torch.cuda.set_device(1)
    receiver = join_receiver(info, 1, manifest)
    got = {}
    receiver.receive(1, lambda it: got.update((n, t.cpu()) for n, t in it))
    out.put({n: t.float().sum().item() for n, t in got.items()})


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL broadcast needs 2 GPUs")
def test_two_gpu_broadcast_matches():
    torch.cuda.set_device(0)
    state = cuda_state()
    manifest = build_manifest(state.items(), bucket_bytes=16384)
    info, store = open_membership("127.0.0.1", 0, 2, 60, "nccl", manifest, "sampled", 1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receive, args=(info, manifest, out))
    proc.start()
    sender = join_sender(info, store, manifest)
    sender.send(state, 1)
    sums = out.get(timeout=120)
    proc.join(timeout=60)
    assert sums == {n: t.float().sum().item() for n, t in state.items()}


def _receive_then_die(info, manifest):
    torch.cuda.set_device(1)
    receiver = join_receiver(info, 1, manifest)

    def load(it):
        next(it)  # the first bucket landed; the receiver dies before taking the rest
        os._exit(1)

    receiver.receive(1, load)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL broadcast needs 2 GPUs")
def test_a_receiver_dying_mid_update_fails_the_sync_within_seconds():
    """N1: the sender's NCCL broadcast of a later bucket never completes; the controller (a watcher
    thread here) sees the process die and aborts the membership; the sender stops waiting at once
    and aborts its communicator (no kernel left spinning on the GPU)."""
    torch.cuda.set_device(0)
    state = {f"w{i}": torch.randn(64, 64, device="cuda") for i in range(8)}  # 16 KiB each: 8 buckets
    manifest = build_manifest(state.items(), bucket_bytes=16384)
    info, store = open_membership("127.0.0.1", 0, 2, 600, "nccl", manifest, "off", 1)
    proc = mp.get_context("spawn").Process(target=_receive_then_die, args=(info, manifest))
    proc.start()
    died_at: list[float] = []

    def controller():
        proc.join()
        died_at.append(time.monotonic())
        abort_membership(info, "controller: the receiver's process died")

    watcher = threading.Thread(target=controller, daemon=True)
    sender = join_sender(info, store, manifest)
    watcher.start()
    with pytest.raises(SyncAborted, match="receiver's process died|NCCL"):
        sender.send(state, 1)
    assert died_at and time.monotonic() - died_at[0] < 10.0  # not weight_sync.timeout_s (600 s)
    assert sender.channel._comm is None  # aborted
    sender.close()
