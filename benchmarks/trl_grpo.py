"""The peer baseline for bench_e2e.py: TRL's GRPOTrainer on the same model, task and batch.

Runs inside TRL's own virtual environment (benchmarks/.venv-trl, made by bench_e2e.py; TRL is not a
dependency of async_rl), so it imports nothing from async_rl: the 'repeat' task's prompts and reward
are restated here (same letters, same reward: the fraction of the first 8 characters equal to the
prompt's letter). Writes one JSON line: steady-state samples/s from the end of the warm-up steps to
the end of the last step, the same window bench_e2e uses for our runs.

    .venv-trl/bin/python benchmarks/trl_grpo.py --model DIR --prompts 16 --group 8 --tokens 64 \
        --steps 12 --warmup 3 --generation hf|vllm [--context TEXT] --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

LETTERS = "abcdefgh"
REWARD_CHARS = 8


def repeat_reward(prompts, completions, answer, **_) -> list[float]:
    return [sum(ch == a for ch in c[:REWARD_CHARS]) / REWARD_CHARS for c, a in zip(completions, answer, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--context", default="", help="fixed text before every prompt (bench_e2e's e2e_task.CONTEXT)")
    ap.add_argument("--generation", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rng = random.Random(0)
    n_prompts = args.prompts * args.steps
    letters = [rng.choice(LETTERS) for _ in range(n_prompts)]
    data = Dataset.from_dict({"prompt": [f"{args.context}{c}:" for c in letters], "answer": letters})
    batch = args.prompts * args.group
    # Fixed-length completions on both sides: no end-of-sequence before --tokens.
    gen_kwargs = {"ignore_eos": True} if args.generation == "vllm" else {"min_new_tokens": args.tokens}
    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl-out"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        generation_batch_size=batch,  # one generation round per optimizer step, as ours
        num_iterations=1,
        max_completion_length=args.tokens,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",  # as ours
        beta=0.0,  # no reference model: ours trains without a KL term too
        mask_truncated_completions=False,
        generation_kwargs=gen_kwargs,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        shuffle_dataset=False,
        log_completions=False,
        seed=0,
        use_vllm=args.generation == "vllm",
        vllm_mode="colocate",
        vllm_max_model_length=args.tokens + len(args.context) + 16,
    )
    marks: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            marks[state.global_step] = time.perf_counter()

    tok = AutoTokenizer.from_pretrained(args.model)
    trainer = GRPOTrainer(model=args.model, reward_funcs=repeat_reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    wall = marks[args.steps] - marks[args.warmup]
    samples = (args.steps - args.warmup) * batch
    with open(args.out, "w") as f:
        json.dump({"samples_per_s": samples / wall, "tokens_per_s": samples * args.tokens / wall, "wall_s": wall,
                   "steps_measured": args.steps - args.warmup, "generation": args.generation,
                   "trl": __import__("trl").__version__, "torch": torch.__version__}, f)


if __name__ == "__main__":
    main()
