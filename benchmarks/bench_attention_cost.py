"""What one forward and backward of a micro-batch costs on each CPU attention path, against the
learner's cost estimate (`models/cost.py`), single-threaded.

The same 2,048 tokens (and one case of 1,024 + 4 x 256) laid out as packed rows of several widths and
as padded rows, run by `learner.attention` sdpa (packed: HF's packed-sequence mask; padded: the padding
mask) and varlen (on CPU the per-segment reference, `attention.reference_varlen`), on tiny-qwen2-wide in
fp32. Each case: a warm-up, then the best of three, in CPU seconds of this process (one thread: what
compares on a loaded machine). The estimate is `CostModel.layout` of the built micro-batch's segment
table for the path the kernel runs (sdpa: `dense`, varlen on CPU: `segments`), converted to seconds by
the 8 x 256 packed case; measured / predicted near 1 says the estimate follows the kernel.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/bench_attention_cost.py --kernels sdpa,varlen

Prints a markdown table (benchmarks/results/attention_cost_cpu.md holds one run).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

CASES = {  # name: (sequence lengths, pack_row_tokens)
    "1 seq 2048, 1 row": ([2048], 0),
    "8 seq 256, rows 256": ([256] * 8, 256),
    "8 seq 256, 1 row 2048": ([256] * 8, 2048),
    "16 seq 128, 1 row 2048": ([128] * 16, 2048),
    "1x1024 + 4x256, rows 256": ([1024] + [256] * 4, 256),
    "4 seq 512, rows 512": ([512] * 4, 512),
    "2 seq 1024, rows 1024": ([1024] * 2, 1024),
}
REFERENCE = ("sdpa", "packed", "8 seq 256, rows 256")  # the case that converts cost units to seconds


def sample(n: int):
    from async_rl.learner.batch.packing import SeqSample

    tokens = np.random.default_rng(n).integers(3, 40, n)
    return SeqSample(tokens=tokens, start=8, behav_logp=np.zeros(n - 8, np.float32), advantages=np.ones(n - 8, np.float32))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="sdpa,varlen")
    p.add_argument("--preset", default="tiny-qwen2-wide")
    args = p.parse_args()
    from async_rl.config import LearnerConfig
    from async_rl.learner.batch.packing import packed, padded
    from async_rl.learner.torch_backend import TorchBackend
    from async_rl.models.cost import CostModel
    from async_rl.models.shape import ModelShape
    from async_rl.models.tiny import resolve_model_path

    torch.set_num_threads(1)
    model_dir = str(resolve_model_path(args.preset, tempfile.mkdtemp(prefix="attention-cost-")))
    weight = ModelShape.read(model_dir).attention_weight()

    def loss_fn(i, scores):
        return scores.logp.sum() / 1000.0

    rows = []
    for kernel in args.kernels.split(","):
        backend = TorchBackend(LearnerConfig(micro_batch_tokens=8192, attention=kernel), "float32", 0, 1, "")
        backend.setup(model_dir)
        cost = CostModel(attention_weight=weight, path=backend.attention_path)
        for layout in ("packed", "padded") if kernel == "sdpa" else ("packed",):
            for name, (lengths, row_tokens) in CASES.items():
                samples = [sample(n) for n in lengths]
                mb = packed(samples, row_tokens) if layout == "packed" else padded(samples)
                estimate = cost.layout(mb.segments.layout())
                mb = mb.to(backend.device)
                backend.forward_backward([mb], 1.0, loss_fn)
                backend.drop_gradients()
                best = float("inf")
                for _ in range(3):
                    t0 = time.process_time()
                    backend.forward_backward([mb], 1.0, loss_fn)
                    best = min(best, time.process_time() - t0)
                    backend.drop_gradients()
                rows.append(((kernel, layout, name), tuple(mb.input_ids.shape), cost.path, estimate, best))
                print(f"{best:7.3f} s  {kernel}/{layout}: {name}", flush=True)
        backend.shutdown()
    unit = next(t / e for key, _, _, e, t in rows if key == REFERENCE)
    print(f"\nattention_weight {weight:.3g}; 1 cost unit = {unit * 1e3:.3f} ms (the {REFERENCE[2]} {REFERENCE[1]} case)\n")
    print("| kernel, layout | sequences | rows x width | path | estimate (token units) | predicted CPU s "
          "| measured CPU s | measured / predicted |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (kernel, layout, name), shape, path, estimate, t in rows:
        print(f"| {kernel}, {layout} | {name} | {shape[0]}x{shape[1]} | {path} | {estimate:.0f} | {estimate * unit:.2f} "
              f"| {t:.2f} | {t / (estimate * unit):.2f} |")


if __name__ == "__main__":
    main()
