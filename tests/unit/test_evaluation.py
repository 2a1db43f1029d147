"""Evaluation: scoring per data source and overall, the schedule, the eval set, and the config."""

from __future__ import annotations

import io
import json

import pytest

from async_rl.config import WandbConfig, load_config
from async_rl.control.metrics import EVAL_FILE, MetricsSink
from async_rl.errors import ConfigError, RunError
from async_rl.evaluation.phase import Evaluation, eval_prompts, split
from async_rl.evaluation.scores import EvalBatch, EvalResult, flat_metrics, make_record, score
from async_rl.models.tiny import resolve_model_path
from async_rl.protocol import FINISH_LENGTH, FINISH_STOP, Prompt


def result(pid: int, source: str, rewards: list[float], lens: list[int] | None = None, cut: int = 0) -> EvalResult:
    lens = lens or [10] * len(rewards)
    reasons = [FINISH_LENGTH] * cut + [FINISH_STOP] * (len(rewards) - cut)
    return EvalResult(prompt_id=pid, data_source=source, rewards=rewards, completion_lens=lens, finish_reasons=reasons)


def test_pass_at_1_per_source_and_overall():
    results = [
        result(0, "gsm8k", [1.0, 0.0, 1.0, 1.0]),  # 3/4
        result(1, "gsm8k", [0.0, 0.0, 0.0, 0.0]),  # 0/4
        result(2, "arith", [1.0, 1.0, 1.0, 1.0]),  # 4/4
    ]
    overall, per = score(results, pass_threshold=1.0)
    assert list(per) == ["arith", "gsm8k"]
    assert per["gsm8k"].prompts == 2 and per["gsm8k"].samples == 8
    assert per["gsm8k"].pass_at_1 == pytest.approx(3 / 8)
    assert per["arith"].pass_at_1 == 1.0
    # Overall averages over every sample (each prompt has n samples, so also over prompts).
    assert overall.pass_at_1 == pytest.approx(7 / 12)
    assert overall.reward == pytest.approx(7 / 12)
    assert overall.prompts == 3 and overall.samples == 12


def test_pass_threshold_separates_reward_from_pass():
    results = [result(0, "repeat", [0.5, 0.75, 1.0, 0.25])]
    overall, _ = score(results, pass_threshold=0.75)
    assert overall.reward == pytest.approx(0.625)
    assert overall.pass_at_1 == pytest.approx(0.5)


def test_record_lengths_truncation_failures_and_versions():
    batches = [
        EvalBatch(engine_id=0, version=4, version_last=4, results=[result(0, "a", [1.0, 0.0], [5, 20], cut=1)]),
        EvalBatch(engine_id=1, version=4, version_last=4, results=[result(1, "b", [1.0, 1.0], [7, 8])], failed_prompts=1),
    ]
    rec = make_record(batches, 1.0, step=4, elapsed_s=12.0, eval_s=3.5)
    assert (rec.step, rec.version, rec.prompts, rec.samples) == (4, 4, 2, 4)
    assert rec.pass_at_1 == pytest.approx(0.75)
    assert rec.completion_len_mean == pytest.approx(10.0) and rec.completion_len_max == 20
    assert rec.truncated_frac == pytest.approx(0.25)
    assert rec.failed_prompts == 1 and rec.eval_s == 3.5
    flat = flat_metrics(rec)
    assert flat["eval/pass@1"] == pytest.approx(0.75) and flat["eval/time_s"] == 3.5
    assert flat["eval/a/pass@1"] == 0.5 and flat["eval/b/pass@1"] == 1.0
    # One data source: no per-source keys, the overall ones say it all.
    single = make_record(batches[:1], 1.0, step=4, elapsed_s=0.0, eval_s=1.0)
    assert not any(k.count("/") > 1 for k in flat_metrics(single))
    mixed = [batches[0], EvalBatch(engine_id=1, version=3, version_last=4, results=[])]
    with pytest.raises(RunError, match="mixed policy versions"):
        make_record(mixed, 1.0, step=4, elapsed_s=0.0, eval_s=1.0)


def test_schedule_start_every_end_and_never_twice():
    cfg = load_config(None, ["eval.enabled=true", "eval.every=3", "train.total_steps=7"]).eval
    ev = Evaluation(cfg, [], default_max_tokens=8, total_steps=7)
    assert ev.due(0, at_start=True)
    assert [s for s in range(1, 8) if ev.due(s)] == [3, 6, 7]
    ev.last_step = 3  # evaluated already (e.g. the end coincides with `every`)
    assert not ev.due(3)
    only_ends = Evaluation(load_config(None, ["eval.enabled=true"]).eval, [], 8, total_steps=5)
    assert [s for s in range(1, 6) if only_ends.due(s)] == [5] and only_ends.due(0, at_start=True)
    off = Evaluation(load_config(None, ["eval.every=1"]).eval, [], 8, total_steps=5)
    assert not off.due(0, at_start=True) and not any(off.due(s) for s in range(1, 6))
    no_start = Evaluation(load_config(None, ["eval.enabled=true", "eval.at_start=false"]).eval, [], 8, 5)
    assert not no_start.due(0, at_start=True)
    # eval.max_tokens 0 = the generators' max_tokens; temperature 0 (greedy) by default.
    assert only_ends.params.max_tokens == 8 and only_ends.params.temperature == 0.0 and only_ends.params.n == 1


def test_task_eval_set_is_held_out_capped_and_split_across_engines(tmp_path):
    cache = str(tmp_path / "models")
    model_dir = resolve_model_path("tiny-qwen2", cache)
    cfg = load_config(None, ["eval.enabled=true", "eval.max_prompts=10", "task.name=modsum", f"model.cache_dir={cache}"])
    prompts = eval_prompts(cfg, model_dir)
    assert len(prompts) == 10 and all(p.data_source == "modsum" and p.token_ids for p in prompts)
    from async_rl.tasks.modsum import ModSumTask

    train = [p.text for _, p in zip(range(10), ModSumTask().prompts(cfg.task.seed), strict=False)]
    assert [p.text for p in prompts] != train  # the held-out seed, another stream
    shares = split(prompts, 3)
    assert [len(s) for s in shares] == [4, 3, 3]
    assert sorted(p.prompt_id for s in shares for p in s) == [p.prompt_id for p in prompts]
    assert split([Prompt(prompt_id=0)], 2)[1] == []


def test_eval_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="eval.max_tokens"):
        load_config(None, ["eval.enabled=true", "eval.max_tokens=500", "generators.max_model_len=128"])
    with pytest.raises(ConfigError, match="eval.temperature"):
        load_config(None, ["eval.temperature=-1"])
    with pytest.raises(ConfigError, match=r"eval.n=4 with eval.temperature=0"):  # vLLM refuses n > 1 when greedy
        load_config(None, ["eval.enabled=true", "eval.n=4", "eval.temperature=0"])
    assert load_config(None, ["eval.enabled=true", "eval.n=4", "eval.temperature=0.6"]).eval.n == 4


def test_eval_records_go_to_their_own_file(tmp_path):
    rec = make_record(
        [EvalBatch(engine_id=0, version=2, version_last=2, results=[result(0, "a", [1.0])])], 1.0, 2, 1.0, 0.5
    )
    out = io.StringIO()
    sink = MetricsSink(tmp_path, WandbConfig(mode="disabled"), {}, 10, stream=out)
    sink.log_eval(rec)
    sink.close()
    lines = (tmp_path / EVAL_FILE).read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["pass_at_1"] == 1.0
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert "eval step    2" in out.getvalue() and "pass@1 1.000" in out.getvalue()


def test_resume_trims_evaluations_of_steps_the_checkpoint_does_not_hold(tmp_path):
    from async_rl.control.checkpoint import trim_metrics

    lines = [json.dumps({"step": s, "pass_at_1": 0.1 * s}) for s in (0, 4, 8, 12)]
    (tmp_path / EVAL_FILE).write_text("\n".join(lines) + "\n")
    # Resumed from step 8: its start evaluates step 8 again; 8 and 12 were the killed run's.
    assert trim_metrics(tmp_path, 8, EVAL_FILE) == 2
    assert [json.loads(line)["step"] for line in (tmp_path / EVAL_FILE).read_text().splitlines()] == [0, 4]
