"""Learner rank 0's side of weight sync, for any backend that can list its weights under HF names.

Holds the broadcast membership (store, sender, generation) across syncs; the backend supplies
`named_tensors()` (full parameters, HF names, the same names and shapes every call).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

from async_rl.cluster.net import advertised_host
from async_rl.config import WeightSyncConfig
from async_rl.weight_sync.base import BucketHook, SendProgress, UpdateReceipt, WeightGroupInfo, WeightSender
from async_rl.weight_sync.bucketing import Manifest, build_manifest, to_dtype
from async_rl.weight_sync.checksum import ParamChecksum, checksum_of
from async_rl.weight_sync.shm import ShmChannel
from async_rl.weight_sync.transport import join_sender, open_membership


class WeightSource:
    def __init__(
        self, cfg: WeightSyncConfig, named_tensors: Callable[[], dict[str, torch.Tensor]], adopt: bool = False,
        served: Callable[[], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """`cfg.backend` resolved (not 'auto'). `adopt`: the named tensors are the live parameters
        (same storage every call), so the shm sender may move them into its mapping once. `served`:
        every weight the engines serve, when a sync sends fewer (a frozen vision tower); the checksum
        covers them (None: the named tensors)."""
        self.cfg = cfg
        self._named_tensors = named_tensors
        self._served = served or named_tensors
        # weight_sync.delta keeps the sender's own wire-dtype baseline: the parameters stay where they are
        self._adopt = adopt and cfg.delta != "on"
        self._store = None
        self._sender: WeightSender | None = None
        self._info: WeightGroupInfo | None = None
        self._generation = 0
        self._manifest: Manifest | None = None
        self._hooks: list[BucketHook] = []

    def on_bucket(self, hook: BucketHook) -> None:
        """Call `hook` after every bucket of every later update, on this membership's sender and on
        the senders of later memberships."""
        self._hooks.append(hook)
        if self._sender is not None:
            self._sender.on_bucket(hook)

    def progress(self) -> SendProgress:
        """How far the current (or last) update of this membership got."""
        return self._sender.progress if self._sender is not None else SendProgress()

    def manifest(self) -> Manifest:
        if self._manifest is None:
            wire = to_dtype(self.cfg.wire_dtype) if self.cfg.wire_dtype else None
            self._manifest = build_manifest(self._named_tensors().items(), self.cfg.bucket_mb << 20, wire)
        return self._manifest

    def open(self, world_size: int) -> WeightGroupInfo:
        self._close_sender()  # the old membership's channel (an NCCL communicator) goes with it
        self._generation += 1
        self._info, self._store = open_membership(
            # Receivers connect to what is published: 0.0.0.0 (bind everywhere) is this node's IP to them.
            advertised_host(self.cfg.host),
            self.cfg.port,
            world_size,
            self.cfg.timeout_s,
            self.cfg.backend,
            self.manifest(),
            self.cfg.checksum,
            self._generation,
            store=self._store,
            delta=self.cfg.delta == "on",
        )
        return self._info

    def join(self) -> None:
        self._sender = join_sender(self._info, self._store, self.manifest(), self._hooks)
        if self._adopt:
            # shm: the parameters move into the shared mapping, so an update needs no packing copy
            # (a sharded backend gathers fresh full tensors for every sync: nothing to keep there).
            self._sender.adopt(self._named_tensors())

    def broadcast(self, version: int, full: bool = False) -> UpdateReceipt:
        """`full`: never a delta (weight_sync.delta's fall-back)."""
        if self._sender is None:
            raise RuntimeError("broadcast_weights before join_weight_group")
        with torch.no_grad():
            receipt = self._sender.send(self._named_tensors(), version, full)
        if receipt.delta:  # checked as served by every engine (weight_sync/verify.py)
            receipt = msgspec.structs.replace(receipt, expected=self.checksum())
        return receipt

    def checksum(self) -> ParamChecksum:
        """Of the weights as they go on the wire (cast to weight_sync.wire_dtype, e.g. bf16 for bf16
        generators): what every receiver then holds, exactly."""
        tensors = self._served().values()
        if self.cfg.wire_dtype:
            wire = to_dtype(self.cfg.wire_dtype)
            tensors = (t.to(wire) if t.is_floating_point() else t for t in tensors)
        return checksum_of(tensors)

    def _close_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def close(self) -> None:
        self._close_sender()
        if self._info is not None and self._info.shm_path:
            ShmChannel.unlink(self._info.shm_path)  # opened but never joined
