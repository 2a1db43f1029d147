"""An MoE block's experts: HF's loop over the experts hit (`eager`) against transformers' grouped GEMMs
(`grouped_mm`, learner.moe_experts auto), forward + backward of one Qwen3-MoE sparse block, with the
outputs and input gradients compared to the loop's. `batched_mm` (each token's top-k experts' weights
gathered, then batched GEMMs) only when asked: it holds tokens x top-k copies of an expert's weights
(25 GB at the defaults: the process was killed for memory here).

Rounds interleaved (A B C A B C: a shared machine's load drifts); the best of each counts. On the CPU
this is torch's grouped matmul for the CPU (torch 2.13); on CUDA the same script measures the kernels
the GPU learner runs (bf16 there). CPU-heavy: run it under /tmp/heavy on the shared machine.
    python benchmarks/bench_moe_experts.py [--tokens 2048] [--hidden 512] [--experts 64] [--top-k 8]
        [--moe-width 256] [--rounds 3] [--device cpu] [--implementations eager,grouped_mm]
writes benchmarks/results/moe_experts[_cuda].json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# the block's shape and the rounds (integer options, these defaults)
SIZES = {"tokens": 2048, "hidden": 512, "experts": 64, "top-k": 8, "moe-width": 256, "rounds": 3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in SIZES.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--implementations", default="eager,grouped_mm", help="the first is the reference")
    a = ap.parse_args()
    impls = a.implementations.split(",")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    device = torch.device(a.device)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=a.hidden, moe_intermediate_size=a.moe_width, num_experts=a.experts,
                         num_experts_per_tok=a.top_k, norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(cfg).to(device, dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    x = torch.randn(1, a.tokens, a.hidden, device=device, dtype=dtype)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for _ in range(a.rounds):
        for impl in impls:
            cfg._experts_implementation = impl  # what model.set_experts_implementation sets
            xi = x.clone().requires_grad_(True)
            if a.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = block(xi)
            out.float().square().sum().backward()
            if a.device == "cuda":
                torch.cuda.synchronize()
            times[impl].append(time.perf_counter() - t)
            outs[impl] = (out.detach().float(), xi.grad.float())
            block.zero_grad(set_to_none=True)
    ref_out, ref_grad = outs[impls[0]]
    rows = {}
    for impl in impls:
        out, grad = outs[impl]
        rows[impl] = {"best_s": min(times[impl]), "times_s": times[impl],
                      "speedup_vs_first": min(times[impls[0]]) / min(times[impl]),
                      "max_abs_out_vs_first": float((out - ref_out).abs().max()),
                      "max_abs_grad_vs_first": float((grad - ref_grad).abs().max())}
        print(f"{impl:>11}: {rows[impl]['best_s']:.3f} s (x{rows[impl]['speedup_vs_first']:.2f} the first), "
              f"|out - first| {rows[impl]['max_abs_out_vs_first']:.1e}, |grad - first| {rows[impl]['max_abs_grad_vs_first']:.1e}")
    result = {"date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "args": vars(a),
              "torch": torch.__version__, "dtype": str(dtype), "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"moe_experts{'_cuda' if a.device == 'cuda' else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
