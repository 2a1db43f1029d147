"""The pure parts of the cuda_ipc weight channel (no GPU needed): the handle's wire form, finding the
sender's GPU among a receiver's devices, region layout, and which backend `auto` picks."""

from __future__ import annotations

import pytest
import torch

from async_rl.config import Config, GeneratorConfig, LearnerConfig, RayConfig, WeightSyncConfig
from async_rl.control.settings import resolve_backend
from async_rl.errors import RunError
from async_rl.weight_sync.bucketing import build_manifest
from async_rl.weight_sync.cuda_ipc import CudaIpcHandle, local_device_index
from async_rl.weight_sync.shm import region_offsets


def handle() -> CudaIpcHandle:
    return CudaIpcHandle(
        device_uuid="GPU-0b3c2f1e-aaaa-bbbb-cccc-0123456789ab",
        handle=bytes(range(64)),  # cudaIpcMemHandle_t is 64 opaque bytes, zeros and 0xff included
        storage_size_bytes=(3 << 30) + 17,
        storage_offset_bytes=512,
        ref_counter_handle=b"/torch_123_456_0",
        ref_counter_offset=9,
        event_handle=b"\x00" * 32 + b"\xff" * 32,
        event_sync_required=True,
    )


def test_handle_round_trips_bit_exact():
    h = handle()
    assert CudaIpcHandle.from_bytes(h.to_bytes()) == h


def test_handle_of_another_shape_is_refused():
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        CudaIpcHandle.from_bytes(msgspec.msgpack.encode({"device_uuid": "GPU-x", "handle": b""}))


def test_receiver_finds_the_senders_gpu_by_uuid_under_its_own_numbering():
    # A vLLM worker with CUDA_VISIBLE_DEVICES=3,1 sees physical GPU 1 as its device 1.
    assert local_device_index("GPU-b", ["GPU-d", "GPU-b"]) == 1
    assert local_device_index("GPU-d", ["GPU-d", "GPU-b"]) == 0


def test_receiver_without_the_senders_gpu_fails_in_one_line_naming_the_backend():
    with pytest.raises(RunError) as info:
        local_device_index("GPU-a", ["GPU-b"])
    msg = str(info.value)
    assert "\n" not in msg
    assert "weight_sync.backend=cuda_ipc" in msg and "GPU-a" in msg and "colocated" in msg
    with pytest.raises(RunError, match="no GPU"):
        local_device_index("GPU-a", [])


def test_region_gives_every_bucket_an_aligned_slot_of_its_own():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 300, 7, 1000, 3])]
    m = build_manifest(named, bucket_bytes=1024)
    offsets = region_offsets(m)
    assert len(offsets) == len(m.buckets) + 1 and offsets[0] == 0
    for k, b in enumerate(m.buckets):
        assert offsets[k] % 64 == 0
        assert offsets[k] + b.nbytes <= offsets[k + 1]  # slots never overlap
    assert offsets[-1] - offsets[-2] < m.buckets[-1].nbytes + 64


@pytest.mark.parametrize(
    ("placement", "device", "ray_address", "want"),
    [
        ("colocated", "cuda", "", "cuda_ipc"),
        ("colocated", "cpu", "", "shm"),
        ("disaggregated", "cuda", "", "nccl"),  # GPUs of their own: NCCL, on one host or many
        ("disaggregated", "cuda", "ray://head:10001", "nccl"),
        ("disaggregated", "cpu", "", "shm"),
        ("disaggregated", "cpu", "ray://head:10001", "gloo"),
    ],
)
@pytest.mark.parametrize("learner", ["torch", "megatron"])
def test_auto_backend(placement, device, ray_address, want, learner):
    """auto follows the device fields (learner.device and generators.device), for either learner."""
    cfg = Config(
        placement=placement,
        learner=LearnerConfig(backend=learner, device=device),
        generators=GeneratorConfig(device=device),
        ray=RayConfig(address=ray_address),
    )
    assert resolve_backend(cfg) == want


def test_auto_backend_needs_both_ends_on_cuda():
    """A CUDA learner with CPU generators (or the reverse) has no GPU channel between them."""
    for learner_dev, gen_dev in [("cuda", "cpu"), ("cpu", "cuda")]:
        cfg = Config(learner=LearnerConfig(device=learner_dev), generators=GeneratorConfig(device=gen_dev))
        assert resolve_backend(cfg) == "shm"


@pytest.mark.parametrize(("placement", "want"), [("colocated", "cuda_ipc"), ("disaggregated", "nccl")])
def test_auto_backend_follows_runs_on_cuda(monkeypatch, placement, want):
    """`runs_on_cuda` is the one place the device decision comes from (the device fields plug in there):
    a torch learner that runs on CUDA gets the GPU channels too."""
    from async_rl.control import settings

    cfg = Config(placement=placement, learner=LearnerConfig(backend="torch"))
    monkeypatch.setattr(settings, "runs_on_cuda", lambda c: True)
    assert settings.resolve_backend(cfg) == want
    monkeypatch.setattr(settings, "runs_on_cuda", lambda c: False)
    assert settings.resolve_backend(cfg) == "shm"


def test_colocated_nccl_is_refused_in_one_line():
    from async_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, ["placement=colocated", "train.max_lag=0", "weight_sync.backend=nccl"])
    msg = str(info.value)
    assert "\n" not in msg and "weight_sync.backend=nccl" in msg and "colocated" in msg
    load_config(None, ["placement=colocated", "train.max_lag=0", "weight_sync.backend=cuda_ipc"])  # accepted


def test_explicit_backend_is_kept():
    cfg = Config(weight_sync=WeightSyncConfig(backend="cuda_ipc"))
    assert resolve_backend(cfg) == "cuda_ipc"
    cfg = Config(placement="colocated", learner=LearnerConfig(backend="megatron"), weight_sync=WeightSyncConfig(backend="gloo"))
    assert resolve_backend(cfg) == "gloo"


def test_receiver_synchronizes_the_loaders_device_not_only_the_mappings(monkeypatch):
    """The mapping is on GPU 0 as this receiver sees it, its parameters on GPU 1: the loader's copies
    are on GPU 1, which must be synchronized before the end barrier lets the sender overwrite."""
    from async_rl.weight_sync import cuda_ipc

    synced: list[torch.device] = []
    monkeypatch.setattr(cuda_ipc, "synchronize", synced.append)
    monkeypatch.setattr(cuda_ipc, "loader_device", lambda: torch.device("cuda", 1))
    channel = cuda_ipc.CudaIpcChannel.__new__(cuda_ipc.CudaIpcChannel)
    channel.device = torch.device("cuda", 0)
    channel.finish_receive()
    assert synced[0] == torch.device("cuda", 1) and set(synced) == {torch.device("cuda", 0), torch.device("cuda", 1)}
    synced.clear()
    channel.device = torch.device("cuda", 1)  # the usual case: one GPU, synchronized once
    channel.finish_receive()
    assert synced == [torch.device("cuda", 1)]
