"""AdamW implementations side by side on the real preset's parameter set: seconds per step, same updates?

The parameters are SmolLM2-135M-Instruct's (configs/smollm2_arith.yaml's model, fp32, the tied
embedding once), the optimizer the torch backend's (betas (0.9, 0.99), the config's lr; weight decay
0.01 so the decoupled decay is exercised too). Each implementation steps its own copy of the weights
with the same seeded gradients; steps are interleaved (A B C A B C: a shared machine's load drifts),
and after the last step every copy's parameters are compared with the reference's (`for_loop`, torch's
CPU default: one parameter at a time).

CPU-heavy: run it under /work/bin/heavy on the shared machine.
    python benchmarks/bench_adamw.py [--steps 6] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CONFIG = REPO / "configs" / "smollm2_arith.yaml"
WEIGHT_DECAY = 0.01


def parameter_shapes() -> tuple[list[torch.Size], float]:
    from transformers import AutoModelForCausalLM

    from async_rl.config import load_config
    from async_rl.models.tiny import resolve_model_path

    cfg = load_config(CONFIG)
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(cfg.model.path, cfg.model.cache_dir)),
                                                 dtype=torch.float32)
    return [p.shape for p in model.parameters()], cfg.learner.lr


def main() -> None:
    from async_rl.learner.optimizer import ADAMW_KERNELS, adamw

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", default=",".join(ADAMW_KERNELS))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    start = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    shapes, lr = parameter_shapes()
    kernels = a.kernels.split(",")
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    params = {k: [torch.nn.Parameter(t.clone()) for t in init] for k in kernels}
    optims = {k: adamw(params[k], lr=lr, weight_decay=WEIGHT_DECAY, kernel=k) for k in kernels}
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for step in range(a.steps):
        grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
        for k in kernels:
            for p, g in zip(params[k], grads, strict=True):
                p.grad = g.clone()
            t0 = time.perf_counter()
            optims[k].step()
            times[k].append(time.perf_counter() - t0)
        print(f"step {step}: " + ", ".join(f"{k} {times[k][-1]:.3f} s" for k in kernels), flush=True)
    ref = kernels[0]
    rows = []
    for k in kernels:
        diff = max(float((p - q).abs().max()) for p, q in zip(params[k], params[ref], strict=True))
        moved = max(float((p - t).abs().max()) for p, t in zip(params[k], init, strict=True))
        timed = times[k][1:]  # the first step allocates the moments
        rows.append({"kernel": k, "step_s": times[k], "step_s_median": statistics.median(timed),
                     "speedup": statistics.median(times[ref][1:]) / statistics.median(timed),
                     "max_abs_diff_vs_" + ref: diff, "max_abs_update": moved})
    result = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/bench_adamw.py " + f"--steps {a.steps} --threads {a.threads} --kernels {a.kernels}",
        "torch": torch.__version__, "parameters": sum(s.numel() for s in shapes), "tensors": len(shapes),
        "lr": lr, "weight_decay": WEIGHT_DECAY, "steps": a.steps, "threads": a.threads,
        "uptime_start": start, "uptime_end": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "rows": rows,
    }
    (RESULTS / "adamw.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
