"""The real preset (smollm2-135m, fp32) through the whole system, a few steps, one engine for the module.

Converts the preset into the shared model cache on first use (ASYNC_RL_MODEL_CACHE, default
~/.cache/async_rl/models: once per machine). Chat prompts rendered by the task into token ids.
"""

from __future__ import annotations

import json
import os

import msgspec
import pytest
import ray

from async_rl.learner.base import Probe
from tests.integration._chat_task import MAX_TOKENS_ENV, MODEL_ENV, STOP, ChatCheckTask
from tests.integration._real_run import read_jsonl, real_config, real_controller, smollm2_dir

pytestmark = pytest.mark.integration

STEPS = 3
PROMPTS, GROUP = 2, 4
MAX_TOKENS = 40
EOS = 2  # SmolLM2's <|im_end|>
EVAL_PROMPTS = 4


class RealRun(msgspec.Struct):
    model_dir: str
    records: list[dict]
    probes: list[Probe]  # every sample of each trained batch, scored by the learner after the sync
    sampling: dict
    learner_ok: list[bool]  # per engine worker: checksum equals the learner's after the last sync
    reward_errors: int
    reward_last_errors: list[str]  # per engine: why its last failed reward failed ('' if none did)
    rendered: list[list[int]]  # the task's first prompts, rendered
    evals: list[dict]  # RUN_DIR/eval.jsonl
    pushed: int  # samples the engines pushed to the buffer (training only)
    leased: int  # samples the buffer leased (training prompts x group size)
    rejected: dict[str, int]  # frames the buffer rejected, by reason


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> RealRun:
    model_dir = smollm2_dir()
    env = {MODEL_ENV: model_dir, MAX_TOKENS_ENV: str(MAX_TOKENS)}
    os.environ.update(env)  # the test process renders prompts with the same task
    run_dir = tmp_path_factory.mktemp("real_run")
    cfg = real_config(
        [
            "task.name=tests.integration._chat_task:make_task",
            f"train.total_steps={STEPS}",
            "train.max_lag=1",
            f"train.prompts_per_step={PROMPTS}",
            f"train.mismatch_probe_samples={PROMPTS * GROUP}",
            f"generators.group_size={GROUP}",
            f"generators.max_tokens={MAX_TOKENS}",
            "generators.max_model_len=128",
            "generators.max_inflight_prompts=4",
            f"generators.stop=[{json.dumps(STOP)}]",
            "learner.lr=1e-5",
            "learner.share_prompt=true",  # the probe scores the batch's groups with one prompt each
            "eval.enabled=true",
            "eval.every=2",
            f"eval.max_prompts={EVAL_PROMPTS}",
        ]
    )
    probes: list[Probe] = []
    sampling: dict = {}
    with real_controller(cfg, run_dir, env) as (controller, sink):

        def after_step(step: int) -> None:
            probes.append(controller.learner.call(lambda a: a.probe_logprobs.remote(PROMPTS * GROUP))[0])
            if not sampling:
                spec = ray.get(controller.generators.actors[0].sampling_spec.remote())
                sampling.update(msgspec.to_builtins(spec))

        controller.run(sink, after_step)
        learner_ck, engine_cks = controller.checksums()
        stats = controller.generators.stats()
        pushed = sum(e.samples_pushed for e in stats)
        last_errors = [e.reward_last_error for e in stats]
        final = controller.shutdown()
    records = read_jsonl(run_dir / "metrics.jsonl")
    for r in records:  # shown with -s: the numbers behind the assertions
        print(
            f"step {r['step']}: mismatch {r['logprob_mismatch']:.2e} len mean {r['completion_len_mean']:.1f} "
            f"p50 {r['completion_len_p50']:.0f} p90 {r['completion_len_p90']:.0f} max {r['completion_len_max']} "
            f"trunc {r['truncation_rate']:.2f} reward {r['reward_mean']:.3f}"
        )
    task = ChatCheckTask()
    prompts = task.prompts(cfg.task.seed)
    return RealRun(
        model_dir=model_dir,
        records=records,
        probes=probes,
        sampling=sampling,
        learner_ok=[ck.close_to(learner_ck) for ck in engine_cks.values()],
        reward_errors=final.reward_errors,
        reward_last_errors=last_errors,
        rendered=[next(prompts).token_ids for _ in range(64)],
        evals=read_jsonl(run_dir / "eval.jsonl"),
        pushed=pushed,
        leased=final.accounts.leased,
        rejected=dict(final.rejected_frames),
    )


def test_vllm_and_learner_logprobs_agree_on_the_same_tokens(run):
    """fp32 on both sides, the learner with one prompt per group and the chunked head (measured ~1e-5)."""
    mismatch = [r["logprob_mismatch"] for r in run.records]
    assert len(mismatch) == STEPS and all(m is not None and m < 1e-4 for m in mismatch), mismatch


def test_every_engine_holds_the_learners_weights_after_a_sync(run):
    assert run.learner_ok and all(run.learner_ok)
    assert [r["version"] for r in run.records] == list(range(1, STEPS + 1))


def test_generation_starts_from_the_rendered_prompt_tokens(run):
    for probe in run.probes:
        for ids, positions in zip(probe.token_ids, probe.positions, strict=True):
            assert ids[: positions[0]] in run.rendered  # exactly the task's chat-rendered tokens


def test_samples_end_at_eos_with_varied_lengths_and_carry_finish_reasons(run):
    # the model's generation config gives the stop token; the engine passes it explicitly
    assert run.sampling["stop_token_ids"] == [EOS] and run.sampling["stop"] == [STOP]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.model_dir)

    def truncated(c: list[int]) -> bool:  # cut at max_tokens: neither EOS nor the stop string ended it
        return len(c) == MAX_TOKENS and c[-1] != EOS and STOP not in tokenizer.decode(c)

    for probe, record in zip(run.probes, run.records, strict=True):
        completions = [ids[p[0]:] for ids, p in zip(probe.token_ids, probe.positions, strict=True)]
        assert len(completions) == PROMPTS * GROUP  # the whole trained batch
        lengths = sorted(len(c) for c in completions)
        cut = [c for c in completions if truncated(c)]
        # the truncation rate comes from the finish reasons on the wire, the count here from the tokens
        assert record["truncation_rate"] == pytest.approx(len(cut) / len(completions))
        assert record["completion_len_max"] == lengths[-1]
        assert record["completion_len_mean"] == pytest.approx(sum(lengths) / len(lengths))
    every = [ids[p[0]:] for probe in run.probes for ids, p in zip(probe.token_ids, probe.positions, strict=True)]
    ends = {"eos": sum(c[-1] == EOS for c in every), "max_tokens": sum(truncated(c) for c in every)}
    print(f"{len(every)} completions: {ends}, the rest ended at the stop string {STOP!r}")
    assert sum(c[-1] == EOS for c in every) >= len(every) // 4, "few samples ended at EOS"
    assert len({len(c) for c in every}) >= 3, "completion lengths do not vary"
    # every reward call saw text matching its tokens and a finish reason matching how they end
    # (each failed one is logged by its engine in one line: "[reward] error ...", with -s)
    assert run.reward_errors == 0, f"last reward errors by engine: {run.reward_last_errors}"


def test_sampling_params_for_vllm():
    from async_rl.serving import vllm_compat as vc
    from async_rl.serving.sampling import SamplingSpec

    p = vc.params_for(SamplingSpec(n=4, max_tokens=8, temperature=0.7, stop=["\n\n"], stop_token_ids=[2, 7]))
    assert (p.n, p.max_tokens, p.temperature, p.stop, p.stop_token_ids) == (4, 8, 0.7, ["\n\n"], [2, 7])
    assert p.include_stop_str_in_output and p.logprobs == 0 and not p.ignore_eos
    assert vc.params_for(SamplingSpec(n=1, max_tokens=8, temperature=1.0, ignore_eos=True)).ignore_eos


def test_the_reward_check_reads_tokens_as_vllm_streams_them():
    """vLLM detokenizes with tokenizers' DecodeStream: tokens that end inside a multi-byte character
    are no text yet. The check's reading of the tokens must agree at every cut (EOS after it too)."""
    import tokenizers
    from transformers import AutoTokenizer

    from tests.integration._chat_task import streamed_text

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    ids = tokenizer("12 + 7 = 19 😀 déjà vu 北京\n\n", add_special_tokens=False).input_ids
    partial = 0
    for cut in range(1, len(ids) + 1):
        for tokens in (ids[:cut], [*ids[:cut], EOS]):
            stream = tokenizers.decoders.DecodeStream(skip_special_tokens=True)
            streamed = "".join(stream.step(tokenizer._tokenizer, t) or "" for t in tokens)
            assert streamed_text(tokenizer, tokens) == streamed, tokens
        partial += tokenizer.decode(ids[:cut]).endswith("\ufffd")
    assert partial >= 2  # the text has cuts inside a character, where a plain decode differs


def test_evaluation_runs_on_the_real_preset_apart_from_training(run):
    # At the start, every eval.every steps and at the end, greedy, on held-out prompts.
    assert [(e["step"], e["version"]) for e in run.evals] == [(0, 0), (2, 2), (3, 3)]
    for e in run.evals:
        assert e["prompts"] == EVAL_PROMPTS and e["samples"] == EVAL_PROMPTS
        # the checking reward of _chat_task passed on every eval sample too (greedy, eval length)
        assert e["reward_failures"] == 0, e
        assert 0.0 <= e["pass_at_1"] <= 1.0 and e["eval_s"] > 0 and e["failed_prompts"] == 0
        assert list(e["per_source"]) == ["chat_check"]
    assert all("pass_at_1" not in r for r in run.records)  # metrics.jsonl holds training steps only
    # Eval samples never reach the buffer: the engines pushed only leased training samples (an eval
    # group pushed there would be rejected as not leased), and their training counters ignore eval.
    assert 0 < run.pushed <= run.leased and not run.rejected
