"""The cuda_ipc channel's protocol on CPU: real gloo groups and the real rendezvous store, threads as
members, and the CUDA calls (allocate, export, map, synchronise) replaced by a CPU region that the
threads share. What runs here is everything but CUDA: the handle through the store, the size check,
per-bucket signalling, adoption, and where the device is synchronised. tests/gpu runs it on a GPU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from async_rl.errors import RunError
from async_rl.weight_sync import cuda_ipc
from async_rl.weight_sync.bucketing import build_manifest
from async_rl.weight_sync.transport import join_receiver, join_sender, open_membership

pytestmark = pytest.mark.integration


class FakeCuda:
    """One region per export, found again by its handle bytes; counts synchronisations per thread."""

    def __init__(self) -> None:
        self.regions: dict[bytes, torch.Tensor] = {}
        self.syncs: list[str] = []
        self.collected = 0

    def new_region(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def export_region(self, region: torch.Tensor) -> cuda_ipc.CudaIpcHandle:
        key = len(self.regions).to_bytes(64, "little")
        self.regions[key] = region
        return cuda_ipc.CudaIpcHandle("GPU-fake", key, region.numel(), 0, b"/ref", 0, b"\0" * 64, False)

    def open_region(self, h: cuda_ipc.CudaIpcHandle) -> torch.Tensor:
        return self.regions[h.handle]

    def loader_device(self) -> torch.device:
        return torch.device("cpu")  # the loader's device: torch.cuda.current_device() needs CUDA

    def synchronize(self, device: torch.device) -> None:
        import threading

        self.syncs.append(threading.current_thread().name)

    def collect_exported(self) -> None:
        self.collected += 1


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda()
    for name in ("new_region", "export_region", "open_region", "loader_device", "synchronize", "collect_exported"):
        monkeypatch.setattr(cuda_ipc, name, getattr(fake, name))
    return fake


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.nn.Parameter(torch.randn(50, 16, generator=g)),
        "layer.0.qkv.weight": torch.nn.Parameter(torch.randn(48, 16, generator=g)),
        "layer.0.norm.weight": torch.nn.Parameter(torch.randn(16, generator=g).to(torch.bfloat16)),
        "layer.0.mlp.weight": torch.nn.Parameter(torch.randn(64, 16, generator=g)),
        "step": torch.tensor([7], dtype=torch.int64),
    }


def run(state, receivers=2, versions=(1, 2), adopt=False, between=None, receiver_manifest=None, close=False):
    manifest = build_manifest(state.items(), bucket_bytes=4096)
    assert len(manifest.buckets) > 1
    info, store = open_membership("127.0.0.1", 0, receivers + 1, 30, "cuda_ipc", manifest, "full", 1)
    assert info.backend == "cuda_ipc" and not info.shm_path

    def receiver(rank):
        rx = join_receiver(info, rank, receiver_manifest or manifest)
        loaded = []
        for v in versions:
            got: dict[str, torch.Tensor] = {}
            rx.receive(v, lambda it, got=got: got.update((n, t.clone()) for n, t in it))
            loaded.append(got)
        if close:
            rx.close()
            return loaded, rx.channel
        return loaded

    with ThreadPoolExecutor(receivers, thread_name_prefix="receiver") as pool:
        futures = [pool.submit(receiver, r) for r in range(1, receivers + 1)]
        sender = join_sender(info, store, manifest)
        moved = sender.adopt(state) if adopt else 0
        sent = []
        for v in versions:
            if between is not None:
                between(v)
            sent.append(sender.send(state, v))
        return manifest, sender, moved, sent, [f.result(timeout=60) for f in futures]


def test_receivers_get_the_senders_weights_bit_exact(fake_cuda):
    state = model_state()
    manifest, _, _, sent, results = run(state)
    for loaded in results:
        for got in loaded:
            for name, t in state.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t.detach()), name
    # The sender synchronised its device before announcing each bucket; each receiver once per
    # update, before the end barrier.
    senders = [s for s in fake_cuda.syncs if not s.startswith("receiver")]
    assert len(senders) == 2 * len(manifest.buckets)
    assert len(fake_cuda.syncs) - len(senders) == 2 * 2
    assert len(fake_cuda.regions) == 1  # one region per membership, not per update


def test_adopted_parameters_live_in_the_region_and_updates_follow_them(fake_cuda):
    state = model_state()
    originals = {n: t.detach().clone() for n, t in state.items()}
    params = {n: t for n, t in state.items() if isinstance(t, torch.nn.Parameter)}

    def optimizer_step(v):
        if v == 2:
            with torch.no_grad():
                for t in state.values():
                    t.add_(1)

    _, sender, moved, _, results = run(state, adopt=True, between=optimizer_step)
    assert moved == len(state)
    region = sender.channel.region
    lo, hi = region.data_ptr(), region.data_ptr() + region.numel()
    for name, p in params.items():
        assert state[name] is p and isinstance(p, torch.nn.Parameter)  # the same objects, re-pointed
        assert lo <= p.data_ptr() < hi, name
    for loaded in results:
        for name, t in originals.items():
            assert torch.equal(loaded[0][name], t), name
            assert torch.equal(loaded[1][name], t + 1), name


def test_receiver_with_another_manifest_is_refused_at_join(fake_cuda):
    state = model_state()
    other = build_manifest([("embed.weight", torch.zeros(10))], bucket_bytes=4096)
    with pytest.raises(RunError, match="sender and receivers disagree"):
        # The sender then waits at its join barrier until the group's timeout: run with one receiver
        # and let the refusal surface from the receiver's thread first.
        manifest = build_manifest(state.items(), bucket_bytes=4096)
        info, store = open_membership("127.0.0.1", 0, 2, 5, "cuda_ipc", manifest, "full", 1)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(join_receiver, info, 1, other)
            try:
                join_sender(info, store, manifest)
            except Exception:  # noqa: BLE001 - the sender times out waiting for the refused receiver
                pass
            future.result(timeout=60)


def test_close_releases_the_region_on_every_member(fake_cuda):
    state = model_state()
    _, sender, _, _, results = run(state, versions=(1,), close=True)
    syncs_before = len(fake_cuda.syncs)
    sender.close()
    channels = [sender.channel] + [channel for _, channel in results]
    assert all(c.region.numel() == 0 for c in channels)  # no member holds the region or a mapping
    assert fake_cuda.collected == 1  # the sender asked torch to free its exported block
    assert len(fake_cuda.syncs) == syncs_before + 1  # it waited for its device before letting go
    sender.close()  # closing twice is harmless
    assert fake_cuda.collected == 1
    with pytest.raises(RuntimeError, match="weight channel was closed"):
        sender.channel.staging(0, 16)
