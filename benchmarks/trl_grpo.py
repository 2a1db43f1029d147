"""The peer baseline for bench_e2e.py: TRL's GRPOTrainer on the same model, task and batch.

Runs inside TRL's own virtual environment (benchmarks/.venv-trl, made by bench_e2e.py; TRL is not a
dependency of async_rl), so it imports nothing from async_rl. Two tasks, restated here:
  - 'repeat' (the tiny presets): the same letters, the same reward (the fraction of the first 8
    characters equal to the prompt's letter), completions forced to --tokens (min_new_tokens);
  - --data FILE (preset real): the first prompts x steps rows of a JSONL file ({prompt, answer}) in
    file order, as chat messages (--system-prompt, then the question) rendered by TRL with the
    model's chat template; the reward is ours (async_rl.tasks.rewards.math_reward) restated:
    math-verify of the completion against \\boxed{answer}; natural EOS, capped at --tokens.
Writes one JSON object: steady-state samples/s and completion tokens/s from the end of the warm-up
steps to the end of the last step (the window bench_e2e uses for our runs), the time spent in
generation + scoring (TRL's _generate_and_score_completions), and every measured completion's length.

    .venv-trl/bin/python benchmarks/trl_grpo.py --model DIR --prompts 16 --group 8 --tokens 64 \
        --steps 12 --warmup 3 --generation hf|vllm [--context TEXT] [--data FILE --system-prompt S] \
        [--temperature 1.0] [--lr 2e-3] --out result.json
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


def _text(completion) -> str:
    """A completion's text: a string (plain prompts) or TRL's conversational [{'role', 'content'}]."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def math_reward(prompts, completions, answer, **_) -> list[float]:
    """async_rl.tasks.rewards.math_reward restated: 1 when math-verify finds the gold answer."""
    from math_verify import parse, verify

    out = []
    for c, a in zip(completions, answer, strict=True):
        gold = parse(a if ("$" in a or "\\boxed" in a) else f"\\boxed{{{a}}}")
        pred = parse(_text(c))
        out.append(1.0 if pred and verify(gold, pred) else 0.0)
    return out


def arith_rows(path: str, n: int) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) < n:
        raise SystemExit(f"{path}: {len(rows)} rows, {n} wanted (prompts x steps)")
    return rows[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--data", default="", help="JSONL {prompt, answer}: chat prompts, math reward, natural EOS")
    ap.add_argument("--system-prompt", default="")
    ap.add_argument("--micro-groups", type=int, default=0,
                    help="prompt groups per forward/backward micro-batch, accumulated to one optimizer step "
                         "(0: the whole batch at once)")
    ap.add_argument("--context", default="", help="fixed text before every prompt (bench_e2e's e2e_task.CONTEXT)")
    ap.add_argument("--generation", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--seed", type=int, default=0, help="TrainingArguments.seed: sampling and initialization")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    n_prompts = args.prompts * args.steps
    lengths: list[list[int]] = []  # completion lengths (tokens, EOS included), one list per generation round
    truncated: list[list[bool]] = []

    def record(completion_ids) -> None:
        lengths.append([len(ids) for ids in completion_ids])
        # TRL's own clipped_ratio test: the last token is not EOS (nor pad)
        truncated.append([len(ids) > 0 and ids[-1] not in stop_ids for ids in completion_ids])

    if args.data:
        rows = arith_rows(args.data, n_prompts)
        system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        data = Dataset.from_dict({"prompt": [[*system, {"role": "user", "content": r["prompt"]}] for r in rows],
                                  "answer": [str(r["answer"]) for r in rows]})
        score = math_reward
        gen_kwargs: dict = {}  # natural EOS, capped at max_completion_length
    else:
        rng = random.Random(0)
        letters = [rng.choice(LETTERS) for _ in range(n_prompts)]
        data = Dataset.from_dict({"prompt": [f"{args.context}{c}:" for c in letters], "answer": letters})
        score = repeat_reward
        # Fixed-length completions on both sides: no end-of-sequence before --tokens.
        gen_kwargs = {"ignore_eos": True} if args.generation == "vllm" else {"min_new_tokens": args.tokens}

    def reward(prompts, completions, answer, completion_ids, **kw) -> list[float]:
        record(completion_ids)
        return score(prompts, completions, answer, **kw)

    batch = args.prompts * args.group
    micro = args.micro_groups or args.prompts
    if args.prompts % micro:
        raise SystemExit(f"--micro-groups {micro} does not divide --prompts {args.prompts}")
    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl-out"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=micro * args.group,
        gradient_accumulation_steps=args.prompts // micro,  # one optimizer step per generation round
        num_generations=args.group,
        generation_batch_size=batch,  # one generation round per optimizer step, as ours
        num_iterations=1,
        max_completion_length=args.tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        lr_scheduler_type="constant",  # as ours
        beta=0.0,  # no reference model: ours trains without a KL term too
        gradient_checkpointing=False,  # TRL 1.x defaults to True (recomputes the forward); ours does not
        mask_truncated_completions=False,
        generation_kwargs=gen_kwargs,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        shuffle_dataset=False,
        log_completions=False,
        seed=args.seed,
        use_vllm=args.generation == "vllm",
        vllm_mode="colocate",
        vllm_max_model_length=args.tokens + len(args.context) + (128 if args.data else 16),
    )
    marks: dict[int, float] = {}
    gen_s: list[float] = []  # seconds in generation + scoring, one per generation round (= per step)

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            marks[state.global_step] = time.perf_counter()

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            gen_s.append(time.perf_counter() - t0)
            return out

    tok = AutoTokenizer.from_pretrained(args.model)
    stop_ids = {tok.eos_token_id, tok.pad_token_id}
    trainer = TimedGRPOTrainer(model=args.model, reward_funcs=reward, args=config, train_dataset=data,
                               processing_class=tok, callbacks=[Clock()])
    trainer.train()
    if len(lengths) != args.steps:
        raise SystemExit(f"expected one generation round per step: {len(lengths)} rounds for {args.steps} steps")
    wall = marks[args.steps] - marks[args.warmup]
    window = range(args.warmup, args.steps)  # round i is generated for step i + 1
    samples = len(window) * batch
    tokens = sum(sum(lengths[i]) for i in window)
    with open(args.out, "w") as f:
        json.dump({"samples_per_s": samples / wall, "tokens_per_s": tokens / wall, "wall_s": wall, "samples": samples,
                   "tokens": tokens, "steps_measured": len(window), "generation": args.generation,
                   "gen_s": sum(gen_s[i] for i in window),
                   "completion_lengths": [n for i in window for n in lengths[i]],
                   "truncated": [t for i in window for t in truncated[i]],
                   "trl": __import__("trl").__version__, "torch": torch.__version__}, f)


if __name__ == "__main__":
    main()
