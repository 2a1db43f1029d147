"""Reward models beside the pool, without Ray or vLLM: verdict parsing, judge templates, config errors,
the classifier's batching and scores, and the counters of reward-model calls made from real reward
worker processes (a classifier served in this process; the judge's endpoint with a scripted model;
tests/integration/test_reward_models_real.py serves the real ones)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from async_rl.config import (
    DEFAULT_JUDGE_TEMPLATE,
    JUDGE_PLACEHOLDERS,
    JUDGE_REQUIRED,
    ClassifierConfig,
    TaskConfig,
    check_judge_template,
    load_config,
)
from async_rl.endpoint.endpoint import ChatEndpoint
from async_rl.endpoint.rendering import ChatRenderer
from async_rl.errors import ConfigError
from async_rl.generator.rewards import RewardRunner
from async_rl.protocol import REWARD_ERROR, REWARD_OK, ChatMessage, Prompt, Sample
from async_rl.reward_models.calls import JudgeCall, RewardModelCounts, question_text
from async_rl.reward_models.classifier import (
    ClassifierModel,
    ClassifierServer,
    ClassifierSettings,
    ClassifyInput,
)
from async_rl.reward_models.verdicts import parse_verdict, render_judge_prompt
from async_rl.serving.sampling import SamplingSpec
from tests.unit._classifier import build_tiny_classifier
from tests.unit.test_agents import ScriptedModel

KEY = "rm-key"


# ---------------------------------------------------------------- verdicts and templates


@pytest.mark.parametrize(
    ("reply", "want"),
    [
        ("YES", 1.0),
        ("The answer matches the reference.\nYes.", 1.0),
        ("no", 0.0),
        ("Yes, it looks right... on reflection, NO", 0.0),  # the last verdict wins
        ("Yesterday I was nobody", None),  # whole words only
        ("I cannot tell.", None),
        ("", None),
    ],
)
def test_yes_no_verdicts(reply, want):
    assert parse_verdict(reply, "yes_no", 10) == want


@pytest.mark.parametrize(
    ("reply", "want"),
    [("Score: 7/10", 0.7), ("8", 0.8), ("I give it 15.", 1.0), ("-2", 0.0), ("3.5 out of 10 ... final: 4", 0.4),
     ("no score", None)],
)
def test_score_verdicts(reply, want):
    got = parse_verdict(reply, "score", 10)
    assert got == want if want is None else math.isclose(got, want)


def test_judge_templates_are_checked_and_rendered():
    assert check_judge_template(DEFAULT_JUDGE_TEMPLATE, JUDGE_PLACEHOLDERS, JUDGE_REQUIRED) == ""
    assert "lacks {completion}" in check_judge_template("Q: {question}", JUDGE_PLACEHOLDERS, JUDGE_REQUIRED)
    assert "names {reply}" in check_judge_template("{question} {reply}", JUDGE_PLACEHOLDERS, JUDGE_REQUIRED)
    assert "not a format string" in check_judge_template("{question} {completion} {", JUDGE_PLACEHOLDERS, JUDGE_REQUIRED)
    text = render_judge_prompt("Q={question} A={completion} R={answer} {{x}}", "2+2?", "it is {4}", "4")
    assert text == "Q=2+2? A=it is {4} R=4 {x}"  # a completion's braces stay as written


def test_question_is_the_last_user_message_or_the_text():
    chat = Prompt(prompt_id=0, messages=[ChatMessage("system", "be brief"), ChatMessage("user", "2+2?")])
    assert question_text(chat) == "2+2?"
    assert question_text(Prompt(prompt_id=0, text="3+3?")) == "3+3?"


# ---------------------------------------------------------------- config


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_judge_config_errors(tmp_path):
    assert "names no model" in _error(['task.reward="judge:"'])
    assert "is not a folder nor a preset" in _error([f"task.reward=judge:{tmp_path / 'missing'}"])
    assert "has no config.json" in _error([f"task.reward=judge:{tmp_path}"])
    assert _error(["task.reward=judge:smollm2-135m", "task.judge.template=Grade {completion}"]).startswith(
        "task.judge.template lacks {question}"
    )
    assert "task.judge.timeout_s=5 must be below task.reward_timeout_s=5" in _error(
        ["task.reward=judge:smollm2-135m", "task.judge.timeout_s=5"]
    )
    cfg = load_config(None, ["task.reward=judge:smollm2-135m", "task.judge.replicas=2"])  # a preset: fine
    assert cfg.task.judge.replicas == 2 and cfg.task.judge.prompt_template() == DEFAULT_JUDGE_TEMPLATE


def test_classifier_config_errors(tmp_path):
    assert "names no folder" in _error(['task.reward="classifier:"'])
    assert "is not a folder" in _error([f"task.reward=classifier:{tmp_path / 'missing'}"])
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert "not a sequence-classification model" in _error([f"task.reward=classifier:{causal}"])
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}})
    )
    assert "task.classifier.label=1: the model has 1 output(s)" in _error(
        [f"task.reward=classifier:{single}", "task.classifier.label=1"]
    )
    assert "softmax over a model with one output" in _error(
        [f"task.reward=classifier:{single}", "task.classifier.transform=softmax"]
    )
    assert load_config(None, [f"task.reward=classifier:{single}"]).task.classifier.label == 0


# ---------------------------------------------------------------- the classifier, in this process


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, smollm2):
    return build_tiny_classifier(tmp_path_factory.mktemp("rm") / "classifier", smollm2, num_labels=1)


def _samples(n: int) -> list[Sample]:
    return [Sample(prompt=Prompt(prompt_id=i, text=f"What is {i} + {i}?", answer=str(2 * i)),
                   completion=f"It is {2 * i + i % 2}.") for i in range(n)]


def _settings(folder, **changes) -> ClassifierSettings:
    base = dict(replica_id=0, folder=str(folder), key=KEY, device="cpu", dtype="float32", threads=1, input_mode="chat",
                label=0, transform="logit", max_length=256, max_batch=8, batch_wait_ms=50.0)
    return ClassifierSettings(**{**base, **changes})


def test_a_batch_scores_as_its_inputs_alone(classifier_dir):
    """Padding inside a batch (with an id no input holds) leaves every input's score as it is alone."""
    model = ClassifierModel(str(classifier_dir), "float32", "cpu", "chat", 0, "logit", 256)
    items = [ClassifyInput(s.prompt.text, s.completion) for s in _samples(5)]
    items.append(ClassifyInput("A longer question, so the batch needs padding?", "Yes."))
    alone = [model.score([i])[0] for i in items]
    together = model.score(items)
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(round(v, 6) for v in alone)) > 1  # a random head tells inputs apart
    sig = ClassifierModel(str(classifier_dir), "float32", "cpu", "chat", 0, "sigmoid", 256).score(items[:1])[0]
    assert sig == pytest.approx(1 / (1 + math.exp(-alone[0])), abs=1e-6)


def test_concurrent_requests_share_batches_and_the_key_is_required(classifier_dir):
    async def run():
        server = ClassifierServer(_settings(classifier_dir))
        endpoint = await server.start()
        try:
            items = [{"question": s.prompt.text, "completion": s.completion} for s in _samples(8)]
            async with httpx.AsyncClient(timeout=30) as client:
                replies = await asyncio.gather(*(
                    client.post(endpoint.base_url + "/classify", json={"inputs": [item]},
                                headers={"Authorization": f"Bearer {KEY}"}) for item in items
                ))
                refused = await client.post(endpoint.base_url + "/classify", json={"inputs": items[:1]},
                                            headers={"Authorization": "Bearer wrong"})
            return [r.json()["scores"][0] for r in replies], refused.status_code, server.stats()
        finally:
            await server.shutdown()

    scores, refused_status, stats = asyncio.run(run())
    model = ClassifierModel(str(classifier_dir), "float32", "cpu", "chat", 0, "logit", 256)
    assert scores == pytest.approx(model.score([ClassifyInput(s.prompt.text, s.completion) for s in _samples(8)]), abs=1e-5)
    assert refused_status == 401 and stats.refused == 1
    assert stats.requests == 8 and stats.batches < 8 and stats.max_batch > 1


# ---------------------------------------------------------------- counters, from real reward workers


def test_classifier_calls_are_counted_by_outcome(classifier_dir):
    task = TaskConfig(reward=f"classifier:{classifier_dir}", classifier=ClassifierConfig(timeout_s=2.0))

    async def run():
        good = ClassifierServer(_settings(classifier_dir))
        slow = ClassifierServer(_settings(classifier_dir, replica_id=1, batch_wait_ms=5000.0))  # waits past timeout_s
        endpoint, slow_endpoint = await good.start(), await slow.start()
        runner = RewardRunner(task, timeout_s=5.0, workers=2)
        try:
            samples = _samples(3)
            runner.endpoints = [endpoint]
            ok = await asyncio.gather(*(runner.score(s) for s in samples))
            runner.endpoints = [type(endpoint)(endpoint.kind, 0, endpoint.base_url, "wrong key", endpoint.model)]
            refused = await runner.score(samples[0])
            runner.endpoints = [slow_endpoint]
            late = await runner.score(samples[0])
            return ok, refused, late, runner.model_counts, runner.counts, runner.last_error
        finally:
            runner.close()
            await good.shutdown()
            await slow.shutdown()

    ok, refused, late, counts, reward_counts, last_error = asyncio.run(run())
    model = ClassifierModel(str(classifier_dir), "float32", "cpu", "chat", 0, "logit", 256)
    want = model.score([ClassifyInput(s.prompt.text, s.completion) for s in _samples(3)])
    assert [v for v, _ in ok] == pytest.approx(want, abs=1e-5) and all(st == REWARD_OK for _, st in ok)
    assert refused == (0.0, REWARD_ERROR) and late == (0.0, REWARD_ERROR)
    assert counts == RewardModelCounts(calls=5, ok=3, unparseable=0, failures=1, timeouts=1)
    assert reward_counts.error == 2 and "RewardModelTimeout" in last_error


def test_judge_verdicts_are_counted_and_see_the_sample(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    model = ScriptedModel(tok, ["YES", "I would rather not say.", "NO"])
    task = TaskConfig(reward="judge:smollm2-135m")

    async def run():
        defaults = SamplingSpec(n=1, max_tokens=8, temperature=0.0, stop_token_ids=[2])
        endpoint = ChatEndpoint(model, ChatRenderer(tok, 2), KEY, unrecorded=defaults)
        await endpoint.start()
        # The scripted model answers at once: the bound only stops a hang. 5 s was too short for the
        # reward worker's start on a loaded machine (every verdict came back REWARD_TIMEOUT).
        runner = RewardRunner(task, timeout_s=60.0, workers=1)
        from async_rl.reward_models.server import JUDGE, RewardEndpoint

        runner.endpoints = [RewardEndpoint(JUDGE, 0, f"http://127.0.0.1:{endpoint.port}/v1", KEY, "scripted")]
        try:
            return [await runner.score(s) for s in _samples(3)], runner.model_counts, endpoint.episodes
        finally:
            runner.close()
            await endpoint.stop()

    scored, counts, episodes = asyncio.run(run())
    assert scored == [(1.0, REWARD_OK), (0.0, REWARD_OK), (0.0, REWARD_OK)]
    assert counts == RewardModelCounts(calls=3, ok=2, unparseable=1)
    assert episodes == {}  # judge calls are recorded nowhere
    seen = tok.decode(model.prompts[1])
    sample = _samples(3)[1]
    want = JudgeCall(task.judge).messages(sample)[-1]["content"]
    assert want in seen and sample.prompt.text in seen and sample.completion in seen and sample.prompt.answer in seen


# ---------------------------------------------------------------- placement, settings, step metrics


def test_judge_replicas_count_in_the_cluster_plan(tmp_path):
    from async_rl.cluster.devices import ClusterView, NodeView
    from async_rl.cluster.placement import plan_placement

    folder = tmp_path / "judge"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    judge = [f"task.reward=judge:{folder}", "task.judge.device=cuda", "task.judge.replicas=2",
             "task.judge.tensor_parallel_size=2", "generators.device=cuda", "learner.device=cuda"]
    cfg = load_config(None, judge)
    view = ClusterView([NodeView("10.0.0.1", {"CPU": 64.0, "GPU": 4.0})], "Ray cluster at test", local=False)
    with pytest.raises(ConfigError) as info:  # 1 engine + 1 rank + 2 replicas x 2 GPUs = 6 > 4
        plan_placement(cfg, cores=[0, 1], view=view)
    assert "reward model need 4 GPUs (2 replicas x 2 per replica)" in str(info.value)
    fits = load_config(None, [*judge, "task.judge.replicas=1"])
    assert plan_placement(fits, cores=[0, 1], view=view) is not None


def test_pool_settings_follow_the_config(tmp_path, classifier_dir):
    from async_rl.reward_models.judge_engine import JudgeEngine
    from async_rl.reward_models.setup import reward_model_pool

    folder = tmp_path / "judge"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    cfg = load_config(None, [f"task.reward=judge:{folder}", "task.judge.device=cpu", "task.judge.max_model_len=256",
                             "task.judge.cpus_per_replica=2"])
    pool = reward_model_pool(cfg, key="k")
    s = pool.make_settings(1)
    assert pool.server_cls is JudgeEngine and pool.bundle == {"CPU": 2}
    assert (s.replica_id, s.key, s.host, s.threads) == (1, "k", "127.0.0.1", 2)
    assert (s.spec.model_dir, s.spec.max_model_len, s.spec.dtype, s.spec.device) == (str(folder), 256, "float32", "cpu")
    on_cluster = load_config(None, [f"task.reward=classifier:{classifier_dir}", "ray.address=10.0.0.1:6379",
                                    "task.classifier.device=cpu"])
    assert reward_model_pool(on_cluster).make_settings(0).host == ""  # its node's IP, resolved where it runs
    assert reward_model_pool(load_config(None, [])) is None


def test_step_metrics_sum_the_engines_counts():
    from async_rl.control.controller import add_reward_model_counts
    from async_rl.control.metrics import StepRecord
    from async_rl.generator.engine import EngineStats

    def engine(i, counts):
        return EngineStats(engine_id=i, version=0, groups_pushed=0, samples_pushed=0, tokens_generated=0, inflight=0,
                           paused=False, idle_s=0.0, failed_requests=0, last_error="", reward_model=counts)

    record = StepRecord(step=0, version=1, elapsed_s=0, reward_mean=0, loss=0, kl_behav=0, logprob_abs_diff=0,
                        logprob_mismatch=None, grad_norm=0, clip_frac=0, tis_frac=0, samples_per_s=0, tokens_per_s=0,
                        learner_wait_s=0, learner_compute_s=0, sync_s=0, generator_version=0, buffer_waiting_groups=0,
                        lag_max=0, lag_mean=0, leased=0, in_flight=0, waiting=0, trained=0, dropped_stale=0, filtered=0,
                        lost=0, accounting_balanced=True, rejected_frames=0, reward_errors=0, reward_timeouts=0)
    add_reward_model_counts(record, [engine(0, RewardModelCounts(5, 3, 1, 1, 0)), engine(1, RewardModelCounts(4, 2, 0, 0, 2)),
                                     engine(2, None)], restarts=1)
    got = (record.reward_model_calls, record.reward_model_unparseable, record.reward_model_failures,
           record.reward_model_timeouts, record.reward_model_restarts)
    assert got == (9, 1, 1, 2, 1)
