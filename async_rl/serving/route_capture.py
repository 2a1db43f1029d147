"""MoE routing capture on the CPU build of vLLM (no Model Runner V2, so no native capture): runs in
vLLM's worker process, set up and read by the worker extension.

A capture function is set on every MoE layer's router (`BaseRouter.set_capture_fn`, the hook vLLM's
own `routed_experts_capturer.py` uses); the router calls it inside the forward with the step's top-k
expert ids, one row per scheduled token. The rows are laid out like vLLM's own inputs for the step:
request i of the persistent batch owns rows `query_start_loc[i] : query_start_loc[i + 1]`, and row j
is the token at `positions[j]` (`gpu_model_runner._prepare_inputs`; on CPU these are host tensors).
So each row lands at [request, position, MoE layer]. A position computed again (a preemption, a
`keep` pause, which clears the KV cache) is overwritten: the routes kept are those of the forward
that produced the KV the request's later tokens attended to.

With prefix caching on, cached prompt tokens never run forward and keep no route: the capture is
refused there at start-up (settings), since their rows would be missing. Requests are keyed by vLLM's
internal ids ("{external}-{8 random}" or, for n > 1, "{index}_{external}-{8 random}"); a request's
routes stay until `take` hands them out; MAX_KEPT bounds what never gets taken (evaluations, aborted
requests), oldest first, counted in `evicted`.
"""

from __future__ import annotations

import collections
import re
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from async_rl.protocol import route_dtype, route_missing

if TYPE_CHECKING:
    import torch

MAX_KEPT = 1024
_INTERNAL_ID = re.compile(r"^(?:(\d+)_)?(.*)-[0-9a-zA-Z]{8}$")


class RouteCapture(msgspec.Struct, frozen=True):
    """An MoE model's routing to record per sample (see protocol.ROUTE_DTYPES for the array). On CUDA
    vLLM's native capture (Model Runner V2, `enable_return_routed_experts`); on CPU our worker
    extension's hook on the routers (serving/route_capture.py)."""

    num_experts: int
    top_k: int
    moe_layers: list[int]  # the model's MoE layers (the native capture has a column for every layer)


class RouteRecorder:
    def __init__(self, runner, layer_ids: list[int], top_k: int, num_experts: int, max_len: int) -> None:
        self._runner = runner
        self._slot = {layer: i for i, layer in enumerate(sorted(layer_ids))}  # MoE layer -> its column
        self._shape = (max_len, len(layer_ids), top_k)
        self.dtype = route_dtype(num_experts)
        self._missing = route_missing(self.dtype)
        self._kept: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._end: dict[str, int] = {}  # request -> one past its highest captured position
        self.evicted = 0

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """The router's hook: this step's top-k ids of MoE layer `layer_id`, one row per scheduled token."""
        runner = self._runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        if num_reqs == 0:  # a warm-up or profiling forward: no request owns its rows
            return
        starts = runner.query_start_loc.np[: num_reqs + 1]
        total = int(starts[-1])
        positions = runner.positions[:total].numpy()
        ids = topk_ids[:total].numpy()
        slot = self._slot[layer_id]
        for i, req in enumerate(batch.req_ids[:num_reqs]):
            lo, hi = int(starts[i]), int(starts[i + 1])
            if hi > lo:
                rows = self._rows(req)
                rows[positions[lo:hi], slot] = ids[lo:hi]
                self._end[req] = max(self._end.get(req, 0), int(positions[hi - 1]) + 1)

    def _rows(self, req: str) -> np.ndarray:
        rows = self._kept.get(req)
        if rows is None:
            rows = self._kept[req] = np.full(self._shape, self._missing, self.dtype)
            while len(self._kept) > MAX_KEPT:
                old, _ = self._kept.popitem(last=False)
                self._end.pop(old, None)
                self.evicted += 1
        return rows

    def take(self, external_ids: list[str]) -> dict[str, dict[int, np.ndarray]]:
        """The routes of the requests submitted under these ids, per id and child index (0 for n = 1),
        each [positions captured, MoE layers, top_k]; handed out once."""
        wanted = set(external_ids)
        out: dict[str, dict[int, np.ndarray]] = {}
        for req in list(self._kept):
            m = _INTERNAL_ID.match(req)
            if m is None or m.group(2) not in wanted:
                continue
            rows = self._kept.pop(req)
            out.setdefault(m.group(2), {})[int(m.group(1) or 0)] = rows[: self._end.pop(req, 0)].copy()
        return out


def bind(model, recorder: RouteRecorder) -> int:
    """Set the recorder's hook on every MoE router of `model`; returns how many."""
    from functools import partial

    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    bound = 0
    for module in model.modules():
        if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
            module.router.set_capture_fn(partial(recorder.capture, module.layer_id))
            bound += 1
    return bound


def moe_layer_ids(model) -> list[int]:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return sorted({m.layer_id for m in model.modules() if isinstance(m, MoERunner)})
