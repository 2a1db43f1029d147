"""How much of a bf16 engine's weights changes per optimizer step: the case for a delta weight sync.

The learner keeps fp32 master weights; a bf16 engine holds them rounded to bf16. After one step most
elements move by less than half a bf16 step and round to the same value, so a sync could send only
the elements whose bf16 value changed. This measures that share on SmolLM2-135M with the arithmetic
recipe's optimizer (AdamW, lr 2e-5, gradient clip 1.0): --steps optimizer steps of cross-entropy on
the arithmetic training answers (Adam's step is ~lr per element whatever the loss, so the density is
the optimizer's, not the task's), and after each step, against the weights of the step before:

  density        changed bf16 elements / all elements (whole model, and the densest tensor)
  sparse bytes   int32 index + bf16 value per changed element, or the dense bf16 tensor where that is
                 smaller, per tensor; against the full sync's bf16 bytes
  mask bytes     the same with a bitmask (1 bit per element) + the changed values instead of indices

    .venv/bin/python benchmarks/bench_delta_density.py [--steps 8] [--lr 2e-5]

Writes benchmarks/results/delta_density_cpu.json. Step 0 -> 1 is usually the densest: Adam's first
steps are its largest relative to the gradient's scale.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from bench_engine_dtype import PROMPTS, RESULTS, smollm2_dir  # benchmarks/ is this script's first path entry

INDEX_BYTES = 4  # int32 flat index
VALUE_BYTES = 2  # bf16


def batch(tok, rows: list[dict]) -> dict[str, torch.Tensor]:
    texts = [f"{r['prompt']} \\boxed{{{r['answer']}}}" for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True)
    enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return enc


def delta_stats(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict:
    changed = total = sparse_bytes = mask_bytes = dense_bytes = 0
    densest = ("", 0.0)
    for name, b in before.items():
        a = after[name]
        n = int((a != b).sum())
        numel = b.numel()
        changed += n
        total += numel
        dense = numel * VALUE_BYTES
        dense_bytes += dense
        sparse_bytes += min(n * (INDEX_BYTES + VALUE_BYTES), dense)
        mask_bytes += min((numel + 7) // 8 + n * VALUE_BYTES, dense)
        if n / numel > densest[1]:
            densest = (name, n / numel)
    return {"density": changed / total, "changed": changed, "elements": total, "delta_bytes": sparse_bytes,
            "full_bytes": dense_bytes, "bytes_ratio": sparse_bytes / dense_bytes,
            "mask_bytes": mask_bytes, "mask_bytes_ratio": mask_bytes / dense_bytes, "densest_tensor": densest[0],
            "densest_density": densest[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]

    def served() -> dict[str, torch.Tensor]:  # what a bf16 engine holds: every trained weight rounded
        return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}

    prev = served()
    steps = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        out = model(**batch(tok, rows[step * args.batch : (step + 1) * args.batch]))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = served()
        s = {"step": step + 1, "loss": float(out.loss), "step_s": time.perf_counter() - t0, **delta_stats(prev, now)}
        prev = now
        steps.append(s)
        print(f"step {s['step']}: loss {s['loss']:.3f} | bf16 elements changed {s['density']:.2%} "
              f"(densest: {s['densest_tensor']} {s['densest_density']:.1%}) | delta {s['delta_bytes'] / 2**20:.1f} MiB "
              f"of {s['full_bytes'] / 2**20:.1f} MiB = {s['bytes_ratio']:.1%}; as a bitmask + values "
              f"{s['mask_bytes_ratio']:.1%}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = {"command": " ".join(["benchmarks/bench_delta_density.py", *sys.argv[1:]]), "model": "smollm2-135m",
           "lr": args.lr, "batch": args.batch, "cpus": os.cpu_count(), "steps": steps}
    (RESULTS / "delta_density_cpu.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
