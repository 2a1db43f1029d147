"""What an engine hands back from an evaluation, and how the controller sums it up.

Engines return small per-prompt results (rewards, lengths, finish reasons, data source), never the
tokens: an evaluation moves a few kilobytes over Ray and nothing over the trajectory sockets.
"""

from __future__ import annotations

from collections import defaultdict

import msgspec

from async_rl.errors import RunError
from async_rl.protocol import FINISH_LENGTH


class EvalParams(msgspec.Struct, frozen=True):
    """How an engine samples eval prompts (temperature 0 = greedy)."""

    n: int
    temperature: float
    max_tokens: int
    seed: int | None = None  # the request's sampling seed (train.deterministic; None: vLLM's own)


class EvalResult(msgspec.Struct, frozen=True):
    """One eval prompt's samples, scored."""

    prompt_id: int
    data_source: str
    rewards: list[float]
    completion_lens: list[int]
    finish_reasons: list[int]  # FINISH_* per sample
    reward_failures: int = 0  # samples whose reward call raised or timed out (scored 0)


class EvalBatch(msgspec.Struct, frozen=True):
    """An engine's answer to one evaluation call."""

    engine_id: int
    version: int  # the policy version the engine held when the call began
    version_last: int  # ... and when it ended (the controller syncs no weights during an evaluation)
    results: list[EvalResult]
    failed_prompts: int = 0  # requests that failed in vLLM (no result)
    # vLLM's engine core died during the call: the prompts without a result go to another engine
    engine_died: bool = False


class SourceScore(msgspec.Struct, frozen=True):
    prompts: int
    samples: int
    reward: float  # mean reward over samples
    pass_at_1: float  # mean over samples of (reward >= pass_threshold)


class EvalRecord(msgspec.Struct, kw_only=True):
    """One evaluation, as written to RUN_DIR/eval.jsonl and logged to wandb under eval/."""

    step: int  # optimizer steps done when evaluated
    version: int  # the policy version the engines held (= step unless train.sync_every > 1)
    elapsed_s: float  # since training started
    eval_s: float  # wall time of this evaluation
    prompts: int
    samples: int
    reward: float
    pass_at_1: float
    completion_len_mean: float
    completion_len_max: int
    truncated_frac: float  # samples cut at max_tokens
    failed_prompts: int
    reward_failures: int
    per_source: dict[str, SourceScore]
    reassigned_prompts: int = 0  # prompts of an engine that died mid-evaluation, scored by another engine
    dead_engines: int = 0  # engines that died during this evaluation (replaced before training went on)


def score(results: list[EvalResult], pass_threshold: float) -> tuple[SourceScore, dict[str, SourceScore]]:
    """Overall and per-data-source scores. pass@1 is the mean over samples of reward >= threshold
    (with n samples per prompt, the unbiased pass@1 estimate); overall averages over all samples."""
    by_source: dict[str, list[EvalResult]] = defaultdict(list)
    for r in results:
        by_source[r.data_source].append(r)
    per = {src: _score(rs, pass_threshold) for src, rs in sorted(by_source.items())}
    return _score(results, pass_threshold), per


def _score(results: list[EvalResult], pass_threshold: float) -> SourceScore:
    rewards = [x for r in results for x in r.rewards]
    if not rewards:
        return SourceScore(prompts=len(results), samples=0, reward=0.0, pass_at_1=0.0)
    return SourceScore(
        prompts=len(results),
        samples=len(rewards),
        reward=sum(rewards) / len(rewards),
        pass_at_1=sum(1 for x in rewards if x >= pass_threshold) / len(rewards),
    )


def make_record(
    batches: list[EvalBatch], pass_threshold: float, step: int, elapsed_s: float, eval_s: float
) -> EvalRecord:
    results = [r for b in batches for r in b.results]
    overall, per = score(results, pass_threshold)
    lens = [n for r in results for n in r.completion_lens]
    reasons = [f for r in results for f in r.finish_reasons]
    versions = {v for b in batches for v in (b.version, b.version_last)}
    if len(versions) > 1:
        raise RunError(f"evaluation at step {step} ran on mixed policy versions {sorted(versions)}")
    return EvalRecord(
        step=step,
        version=versions.pop() if versions else step,
        elapsed_s=elapsed_s,
        eval_s=eval_s,
        prompts=overall.prompts,
        samples=overall.samples,
        reward=overall.reward,
        pass_at_1=overall.pass_at_1,
        completion_len_mean=sum(lens) / len(lens) if lens else 0.0,
        completion_len_max=max(lens, default=0),
        truncated_frac=sum(1 for f in reasons if f == FINISH_LENGTH) / len(reasons) if reasons else 0.0,
        failed_prompts=sum(b.failed_prompts for b in batches),
        reward_failures=sum(r.reward_failures for r in results),
        per_source=per,
    )


def flat_metrics(record: EvalRecord) -> dict[str, float]:
    """wandb keys: eval/reward, eval/pass@1, eval/<source>/... when there are several sources."""
    out = {
        "eval/reward": record.reward,
        "eval/pass@1": record.pass_at_1,
        "eval/completion_len_mean": record.completion_len_mean,
        "eval/completion_len_max": float(record.completion_len_max),
        "eval/truncated_frac": record.truncated_frac,
        "eval/time_s": record.eval_s,
        "eval/failed_prompts": float(record.failed_prompts),
        "eval/reassigned_prompts": float(record.reassigned_prompts),
    }
    if len(record.per_source) > 1:
        for src, s in record.per_source.items():
            out[f"eval/{src}/reward"] = s.reward
            out[f"eval/{src}/pass@1"] = s.pass_at_1
    return out


def console_line(record: EvalRecord) -> str:
    per = ""
    if len(record.per_source) > 1:
        per = " (" + ", ".join(f"{src} {s.pass_at_1:.3f}" for src, s in record.per_source.items()) + ")"
    failed = f" | failed {record.failed_prompts}" if record.failed_prompts else ""
    if record.dead_engines:
        failed += f" | {record.dead_engines} engine(s) died, {record.reassigned_prompts} prompts reassigned"
    return (
        f"eval step {record.step:>4} | v{record.version:<4} | reward {record.reward:6.3f} | "
        f"pass@1 {record.pass_at_1:.3f}{per} | len mean {record.completion_len_mean:.1f} max "
        f"{record.completion_len_max} | truncated {record.truncated_frac:.2f} | {record.prompts} prompts, "
        f"{record.samples} samples in {record.eval_s:.1f}s{failed}"
    )
