"""The cuda_ipc weight channel on a real GPU: the sender (this process) and a receiver in a second
process (spawn) on the same device, as a colocated learner and vLLM worker are.

What the receiver got comes back as bytes (dtype name, shape, raw bytes), never as tensors: torch
shares a tensor put on a multiprocessing queue through a file descriptor of the putting process,
which is gone once that process exits."""

from __future__ import annotations

import multiprocessing as mp

import msgspec
import pytest
import torch

from async_rl.weight_sync.base import CorruptUpdate, WeightGroupInfo
from async_rl.weight_sync.bucketing import (
    CHUNK_BYTES,
    Manifest,
    build_manifest,
    chunk_counts,
    device_chunk_hashes,
    to_dtype,
)
from async_rl.weight_sync.transport import join_receiver, join_sender, open_membership

TIMEOUT_S = 120

Raw = tuple[str, list[int], bytes]  # a tensor across processes: dtype name, shape, bytes


def to_raw(t: torch.Tensor) -> Raw:
    data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return str(t.dtype).removeprefix("torch."), list(t.shape), data


def from_raw(raw: Raw) -> torch.Tensor:
    dtype, shape, data = raw
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(to_dtype(dtype)).view(shape)


def cuda_state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "embed.weight": torch.nn.Parameter(torch.randn(512, 256, device="cuda", generator=g)),  # 512 KiB
        "layers.0.qkv.weight": torch.nn.Parameter(torch.randn(768, 256, device="cuda", generator=g)),
        "layers.0.norm.weight": torch.nn.Parameter(torch.randn(256, device="cuda", generator=g).to(torch.bfloat16)),
        "layers.0.mlp.weight": torch.nn.Parameter(torch.randn(1024, 256, device="cuda", generator=g)),  # 1 MiB
        "step": torch.tensor([7], dtype=torch.int64, device="cuda"),
    }


def _receive(info_bytes: bytes, manifest_bytes: bytes, versions: list[int], corrupt_bucket: int, out) -> None:
    """Second process: join, receive every version into CUDA parameters of its own, report them."""
    try:
        torch.cuda.set_device(0)
        manifest = msgspec.msgpack.decode(manifest_bytes, type=Manifest)
        rx = join_receiver(msgspec.msgpack.decode(info_bytes, type=WeightGroupInfo), 1, manifest)
        assert rx.channel.region.is_cuda
        if corrupt_bucket >= 0:
            original = rx.channel.post_receive

            def post_receive(k, nbytes):
                buf, pending = original(k, nbytes)
                seen = torch.empty_like(buf)  # what this receiver read; never write into the sender's region

                class Corrupting:  # a Pending (weight_sync.base): wait(timeout) like c10d's Work
                    def wait(self, timeout=None):
                        pending.wait(timeout) if timeout is not None else pending.wait()
                        seen.copy_(buf)
                        if k == corrupt_bucket:
                            seen[-1] ^= 0xFF  # the last byte: in the bucket's last chunk, which 'sampled' checks
                        torch.cuda.synchronize()

                return seen, Corrupting()

            rx.channel.post_receive = post_receive
        results = []
        for v in versions:
            params: dict[str, torch.Tensor] = {}

            def load(named, params=params):
                for name, t in named:
                    params[name] = torch.empty_like(t).copy_(t)  # on the GPU, as vLLM's loader copies

            try:
                receipt = rx.receive(v, load)
                results.append(("ok", receipt.checksum, {n: to_raw(t) for n, t in params.items()}))
            except CorruptUpdate as e:
                results.append(("corrupt", str(e), {}))
        rx.close()  # drop the mapping before the sender lets go of its region
        out.put(results)
    except BaseException as e:  # noqa: BLE001 - report any failure to the test instead of hanging it
        out.put([("error", repr(e), {})])
        raise


def run_update(state, versions, adopt=False, between=None, corrupt_bucket=-1, checksum="sampled"):
    manifest = build_manifest(state.items(), bucket_bytes=1 << 20)
    assert len(manifest.buckets) > 1
    info, store = open_membership("127.0.0.1", 0, 2, TIMEOUT_S, "cuda_ipc", manifest, checksum, 1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (msgspec.msgpack.encode(info), msgspec.msgpack.encode(manifest), list(versions), corrupt_bucket, out)
    proc = ctx.Process(target=_receive, args=args)
    proc.start()
    try:
        sender = join_sender(info, store, manifest)
        moved = sender.adopt(state) if adopt else 0
        sent = []
        for v in versions:
            if between is not None:
                between(v)
            sent.append(sender.send(state, v))
        results = out.get(timeout=TIMEOUT_S)
        proc.join(timeout=TIMEOUT_S)
    finally:
        if proc.is_alive():
            proc.terminate()
    assert results[0][0] != "error", results[0][1]
    results = [(status, detail, {n: from_raw(r) for n, r in got.items()}) for status, detail, got in results]
    return sender, moved, sent, results


def test_receiver_in_another_process_gets_the_weights_bit_exact():
    state = cuda_state()
    _, _, sent, results = run_update(state, versions=[1, 2], checksum="full")
    for (status, checksum, got), receipt in zip(results, sent, strict=True):
        assert status == "ok" and checksum == receipt.checksum != ""
        assert got.keys() == state.keys()
        for name, t in state.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t.detach().cpu()), name
    chunks = sum(chunk_counts(build_manifest(state.items(), bucket_bytes=1 << 20)))
    assert [r.chunks_checked for r in sent] == [chunks, chunks]  # 'full': every MiB of every bucket, both times


@pytest.mark.parametrize("checksum", ["full", "sampled"])
def test_corrupted_bucket_is_detected(checksum):
    _, _, _, results = run_update(cuda_state(), versions=[1], corrupt_bucket=1, checksum=checksum)
    status, message, _ = results[0]
    assert status == "corrupt" and "checksum mismatch" in message and "bucket 1" in message


def test_adopted_learner_parameters_live_in_the_region_and_updates_follow_them():
    state = cuda_state()
    originals = {n: t.detach().clone() for n, t in state.items()}
    params = dict(state)

    def optimizer_step(v):
        if v == 2:
            with torch.no_grad():
                for t in state.values():
                    t.add_(1)  # in place on the GPU, asynchronously: the channel must sync before signalling

    sender, moved, _, results = run_update(state, versions=[1, 2], adopt=True, between=optimizer_step)
    assert moved == len(state)
    region = sender.channel.region
    lo, hi = region.data_ptr(), region.data_ptr() + region.numel()
    for name, t in state.items():
        assert t is params[name] and t.is_cuda
        assert lo <= t.data_ptr() < hi, name  # lives in the exported region: sends need no packing
    assert [r[0] for r in results] == ["ok", "ok"]
    for name, t in originals.items():
        assert torch.equal(results[0][2][name], t.cpu()), name
        assert torch.equal(results[1][2][name], (t + 1).cpu()), name
    sender.close()
    assert sender.channel.region.numel() == 0  # the channel let go (the parameters still hold their block)
    assert all(lo <= t.data_ptr() < hi for t in state.values())


def test_device_chunk_hashes_on_cuda_equal_those_on_the_cpu():
    buf = torch.randint(0, 256, (3 * CHUNK_BYTES + 777,), dtype=torch.uint8, device="cuda")
    chunks = [0, 1, 3]  # a run of whole chunks and the short odd-length last one
    assert device_chunk_hashes(buf, chunks).tolist() == device_chunk_hashes(buf.cpu(), chunks).tolist()
