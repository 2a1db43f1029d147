"""One torch learner step per `learner.attention` kernel on synthetic batches of the real shapes.

No download and no generation: a random-init Qwen2 model of a named shape (`smollm2`: SmolLM2-135M's
dimensions, 30 layers, hidden 576, 9 query / 3 KV heads, vocabulary 49,152; `qwen05`: Qwen2.5-0.5B's,
24 layers, hidden 896, 14 / 2 heads, vocabulary 151,936) and random tokens laid out as

  arith  8 prompts of 35 tokens x 6 samples, completions 20-64 tokens (configs/smollm2_arith.yaml's
         shape; micro_batch_tokens 2048 as there);
  tools  6 prompts of 313 tokens x 6 samples, completions 10-60 tokens with their middle 29% marked as
         environment tokens (configs/smollm2_tools.yaml's; 2048);
  gpu    64 prompts of 90-200 tokens x 8 samples, completions long-tailed (mean ~264, cap 512: the
         1-GPU recipe's shape; micro_batch_tokens 16384).

Each (kernel, batch) runs in its own child process through the real driver path (`LearnerDriver.
train_on_shard`: advantages, micro-batches with the default share_prompt, loss, backward, AdamW),
a warm-up step on one group first, then `--repeats` timed steps (best and all are printed). The
first timed step's training log-probs are compared across kernels (max abs difference from the
first kernel listed). `default` runs the config's defaults, the only variant the code before
`learner.attention` has: run the script with PYTHONPATH pointing at either tree for a before/after.

    PYTHONPATH=$PWD python benchmarks/bench_attention.py --device cpu --batches arith,tools --kernels default
    PYTHONPATH=$PWD python benchmarks/bench_attention.py --device cuda --shape qwen05 --batches gpu \
        --kernels sdpa,varlen,flex
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocabulary
    "tiny": (128, 256, 2, 4, 2, 64),
    "smollm2": (576, 1536, 30, 9, 3, 49152),
    "smollm2-8": (576, 1536, 8, 9, 3, 49152),  # its first 8 layers: the per-micro-batch costs weigh more
    "qwen05": (896, 4864, 24, 14, 2, 151936),
}
BATCHES = {  # groups, group size, prompt range, completion range, micro_batch_tokens, env-token share
    "arith": (8, 6, (35, 35), (20, 64), 2048, 0.0),
    "tools": (6, 6, (313, 313), (10, 60), 2048, 0.29),
    "gpu": (64, 8, (90, 200), (16, 512), 16384, 0.0),
}


def make_model(shape: str, folder: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from async_rl.models.tiny import build_tokenizer

    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_id=0, bos_token_id=0, pad_token_id=2)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)


def make_groups(batch: str, vocab: int, seed: int = 0) -> list:
    from async_rl.protocol import TrajectoryGroup

    n_groups, size, (p_lo, p_hi), (c_lo, c_hi), _, env = BATCHES[batch]
    rng = np.random.default_rng(seed)
    out = []
    for gi in range(n_groups):
        prompt = rng.integers(3, vocab, int(rng.integers(p_lo, p_hi + 1))).astype(np.int32)
        if batch == "gpu":  # long-tailed: most short, some at the cap
            lens = np.minimum(c_hi, c_lo + rng.exponential(250, size)).astype(int)
        else:
            lens = rng.integers(c_lo, c_hi + 1, size)
        comps = [rng.integers(3, vocab, int(n)).astype(np.int32) for n in lens]
        masks = None
        if env:
            masks = []
            for c in comps:
                m = np.ones(len(c), dtype=np.int8)
                k = int(round(env * len(c)))
                start = (len(c) - k) // 2
                m[start : start + k] = 0
                masks.append(m)
        out.append(TrajectoryGroup(
            prompt_id=gi, engine_id=0, prompt_tokens=prompt, completions=comps,
            logprobs=[(-2.0 + 0.1 * rng.standard_normal(len(c))).astype(np.float32) for c in comps],
            rewards=[float(r) for r in rng.random(size)], version_first=[0] * size, version_last=[0] * size,
            reward_status=[0] * size, loss_masks=masks,
        ))
    return out


def child(a: argparse.Namespace) -> None:
    import torch

    from async_rl.config import (
        AlgorithmConfig,
        GeneratorConfig,
        LearnerConfig,
        ModelConfig,
        TrainConfig,
        WeightSyncConfig,
    )
    from async_rl.config.spec import LearnerSpec
    from async_rl.learner.driver import LearnerDriver

    torch.set_num_threads(a.threads)
    _, _, _, _, mbt, _ = BATCHES[a.batch]
    learner = {"lr": 2e-5, "micro_batch_tokens": mbt, "device": a.device}
    if a.kernel != "default":
        learner["attention"] = a.kernel
    spec = LearnerSpec(
        model=ModelConfig(path=a.model_dir, dtype="float32"), learner=LearnerConfig(**learner),
        algorithm=AlgorithmConfig(), generators=GeneratorConfig(max_tokens=512, temperature=0.7),
        train=TrainConfig(total_steps=100, seed=0), run_id="bench",
        weight_sync=WeightSyncConfig(backend="gloo", bucket_mb=1, host="127.0.0.1", timeout_s=10.0),
        model_dir=a.model_dir, reference_model_dir=a.model_dir, buffer_address="tcp://127.0.0.1:1", batch_timeout_s=1.0,
    )
    rank = LearnerDriver(spec, 0, 1, "", [])
    rank.setup()
    vocab = SHAPES[a.shape][5]
    gs = make_groups(a.batch, vocab)
    rank.train_on_shard(0, gs[:1])  # warm-up (compiles where a kernel compiles)
    logps: list = []
    real = rank.backend.forward_backward

    def spy(mbs, temperature, loss_fn):
        def keep(i, scores):
            logps.extend(mbs[i].per_sequence(scores.logp))
            return loss_fn(i, scores)

        real(mbs, temperature, keep)

    times, cpu = [], []
    cuda = rank.device.type == "cuda"
    for r in range(a.repeats):
        rank.backend.forward_backward = spy if r == 0 else real
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0, c0 = time.perf_counter(), time.process_time()
        rank.train_on_shard(r + 1, gs)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    tokens = sum(len(g.prompt_tokens) + len(c) for g in gs for c in g.completions)
    result = {"kernel": a.kernel, "batch": a.batch, "times": times, "cpu_s": cpu, "tokens": tokens,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
              "logp": [x.tolist() for x in logps]}
    Path(a.result).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--batches", default="arith,tools")
    ap.add_argument("--kernels", default="default", help="default and/or learner.attention values")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-dir", default="", help="a model folder made by an earlier run ('' = make one)")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", help=argparse.SUPPRESS)
    ap.add_argument("--kernel", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    model_dir = a.model_dir or tempfile.mkdtemp(prefix=f"bench-attention-{a.shape}-")
    if not (Path(model_dir) / "config.json").is_file():
        make_model(a.shape, Path(model_dir))
    rows = []
    for batch in a.batches.split(","):
        ref = None
        for kernel in a.kernels.split(","):
            result = Path(tempfile.mkstemp(suffix=".json")[1])
            cmd = [sys.executable, __file__, "--child", "--device", a.device, "--shape", a.shape, "--batch", batch,
                   "--kernel", kernel, "--repeats", str(a.repeats), "--threads", str(a.threads),
                   "--model-dir", model_dir, "--result", str(result)]
            proc = subprocess.run(cmd, env=os.environ.copy(), capture_output=True, text=True)
            if proc.returncode:
                print(f"{batch} {kernel}: failed\n{proc.stderr[-3000:]}", flush=True)
                continue
            r = json.loads(result.read_text())
            logp = np.concatenate([np.asarray(x) for x in r.pop("logp")])
            ref = logp if ref is None else ref
            r["logp_diff"] = float(np.abs(logp - ref).max()) if len(logp) == len(ref) else None
            rows.append(r)
            print(f"{batch:6s} {kernel:8s} step s {min(r['times']):7.2f} (runs {', '.join(f'{t:.2f}' for t in r['times'])})"
                  f"  CPU s {min(r['cpu_s']):7.2f}  tokens {r['tokens']}  tokens/s {r['tokens'] / min(r['times']):9.0f}"
                  f"  peak GiB {r['peak_gib'] if r['peak_gib'] is None else round(r['peak_gib'], 2)}"
                  f"  max |logp - {a.kernels.split(',')[0]}| {r['logp_diff']}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": a.device, "shape": a.shape, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
