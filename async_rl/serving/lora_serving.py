"""vLLM's side of LoRA training (learner.lora): one adapter slot, updated in place while the engine is
paused, and read back from the weights vLLM computes with. Runs inside a vLLM worker (called by the
worker extension); imports vLLM lazily.

Why one slot updated in place (read in vLLM 0.32, vllm/lora/): an adapter registered with the
worker's LoRA manager is used by every request that names its id; `remove_adapter` +
`add_adapter` + `activate_adapter` of the same id, while the engine is paused (no forward pass in
flight: a collective_rpc runs between engine steps), swaps the weights in its slot. Every request
then carries the same `LoRARequest` for the whole run, so the rules of full weight updates hold
unchanged: requests kept across a pause continue on the new adapter (version_first/version_last
record it), the buffer's staleness rule applies as is, and the slot count is constant. One adapter
id per version would instead need every request path (continuations after an abort-mode pause,
episodes, evaluation, probes) to pick the version's id, and old ids to be retired only once no
request uses them.

The request's `lora_path` is never read: the adapter is registered before any request names it. It
is a path that does not exist, so if vLLM ever tried to load it from disk (an evicted adapter), the
request would fail loudly instead of serving something else.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from async_rl.weight_sync.checksum import ParamChecksum, checksum_of

SERVED_LORA_ID = 1  # the id every request names (vLLM ids start at 1)
SERVED_LORA_NAME = "async_rl-policy"
SERVED_LORA_PATH = "/nonexistent/async_rl/adapter-is-sent-over-the-weight-group"


def peft_helper_dict(rank: int, alpha: float, target_modules: list[str]) -> dict:
    """The fields of adapter_config.json vLLM's PEFTHelper needs."""
    return {"r": rank, "lora_alpha": alpha, "target_modules": list(target_modules), "bias": "none"}


def _manager(worker):
    lm = getattr(worker.model_runner, "lora_manager", None)
    if lm is None:
        raise RuntimeError("this vLLM engine was started without enable_lora")
    return lm._adapter_manager


def install_adapter(worker, tensors: dict[str, torch.Tensor], config: dict, lora_id: int) -> None:
    """Register `tensors` (PEFT saved names) as adapter `lora_id` and put it in a slot, replacing
    what that id held. Call only while the engine is paused."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    am = _manager(worker)
    dtype = worker.model_runner.lora_config.lora_dtype
    dtype = dtype if isinstance(dtype, torch.dtype) else worker.model_runner.model_config.dtype
    # Copies: the received tensors are views into the weight channel's buckets (reused next update).
    own = {name: t.to(dtype=dtype, copy=True) for name, t in tensors.items()}
    lora = LoRAModel.from_lora_tensors(
        lora_id, own, PEFTHelper.from_dict(config), device="cpu", dtype=dtype, **model_name_mapping(am.model)
    )
    am.remove_adapter(lora_id)
    am.add_adapter(lora)
    am.activate_adapter(lora_id)


def model_name_mapping(model) -> dict:
    """How vLLM's own LoRA loader (`worker_manager.WorkerLoRAManager._load_adapter`) maps an adapter's
    HF names onto `model`'s modules: its `hf_to_vllm_mapper`, renames only, and the prefixes it skips.
    A text model's renames nothing (Qwen2/Llama's mapper only stacks q/k/v, which the rename mapper
    drops); Qwen2.5-VL's renames 'model.language_model.' to 'language_model.model.', without which no
    tensor of its adapter would land on a module (the read-back then finds none and the sync stops)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return {
        "weights_mapper": mapper.get_rename_mapper() if mapper is not None else None,
        "skip_prefixes": getattr(model, "lora_skip_prefixes", None),
    }


def install_zero_adapter(worker, rank: int, lora_id: int) -> None:
    """At start: adapter `lora_id` with zero weights (the base model), so requests may name it from the
    first one on; the first weight sync replaces it."""
    am = _manager(worker)
    am.remove_adapter(lora_id)
    am.add_adapter(am.create_dummy_lora(lora_id, rank, worker.model_runner.lora_manager.embedding_modules))
    am.activate_adapter(lora_id)


def served_parts(worker, lora_id: int) -> Iterator[torch.Tensor]:
    """The adapter's weights as vLLM computes with them: its slot of every LoRA layer's stacked A and B
    (B with alpha / r folded in by vLLM), cut to the adapter's rank; slices without an adapter (A all
    zero: a target module the adapter does not have, e.g. k of a packed qkv) are skipped."""
    am = _manager(worker)
    try:
        index = am.lora_index_to_id.index(lora_id)
    except ValueError:
        raise RuntimeError(f"LoRA adapter {lora_id} is in no slot: vLLM serves it to no request") from None
    r = am.get_adapter(lora_id).rank
    for module in am.modules.values():
        stacked_a, stacked_b = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
        if not isinstance(stacked_a, tuple | list) or not isinstance(stacked_b, tuple | list):
            continue  # not a linear LoRA layer (this adapter targets linear modules only)
        for a, b in zip(stacked_a, stacked_b, strict=True):
            a_slot, b_slot = a[index, 0, :r, :], b[index, 0, :, :r]
            if a_slot.any():
                yield a_slot
                yield b_slot


def served_checksum(worker, lora_id: int = SERVED_LORA_ID) -> ParamChecksum:
    return checksum_of(served_parts(worker, lora_id))


def lora_request():
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=SERVED_LORA_NAME, lora_int_id=SERVED_LORA_ID, lora_path=SERVED_LORA_PATH)


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's MaxLoRARanks


def max_lora_rank(rank: int) -> int:
    """vLLM accepts only some max_lora_rank values: the smallest that holds `rank`."""
    for r in _VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {_VLLM_LORA_RANKS[-1]}")
