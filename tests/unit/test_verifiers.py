"""`env.name: verifiers:ID` without verifiers installed: the endpoint's streamed chat completions (what
verifiers' harness programs ask for), the routing of verifiers:ID to the bridge agent with its ID,
the bridge's reward contract, and the one-line errors of the config and the interpreter check.
With a verifiers venv, real verifiers episodes against the scripted model (exact rewards and tokens);
tests/integration/test_verifiers_real.py runs them against a real engine."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import openai
import pytest

from async_rl.agents.episodes import VERIFIERS_BRIDGE, AgentEpisodes
from async_rl.agents.runner import AgentJob, run_agent
from async_rl.agents.verifiers_bridge import episode_reward
from async_rl.config import EnvConfig, load_config
from async_rl.envs.verifiers_env import check_interpreter, id_error
from async_rl.errors import ConfigError
from async_rl.protocol import REWARD_ERROR, REWARD_OK, ChatMessage, Prompt
from tests.unit._verifiers_venv import VF_PYTHON, examples_pythonpath, unavailable
from tests.unit.test_agents import KEY, SAMPLING, serve

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


# ---- stream: true ----------------------------------------------------------------------------------


def test_a_streamed_chat_completion_is_the_whole_reply_as_events_and_is_recorded_once(tokenizer):
    async def go():
        endpoint, model = serve(tokenizer, [CALL, "It is \\boxed{5}.", "It is \\boxed{5}."])
        await endpoint.start()
        endpoint.open_episode("ep", SAMPLING, 4)
        try:
            client = openai.AsyncOpenAI(base_url=endpoint.base_url("ep"), api_key=KEY, max_retries=0)
            messages = [{"role": "user", "content": "What is 2+3?"}]
            stream = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                                          stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            async with client.chat.completions.stream(model="m", messages=messages, tools=TOOLS) as sdk:
                async for _ in sdk:
                    pass
                assembled = await sdk.get_final_completion()
            plain = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        finally:
            await endpoint.stop()
        return chunks, assembled, plain, endpoint.close_episode("ep"), model

    chunks, assembled, plain, log, model = asyncio.run(go())
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.finish_reason is None
    (call,) = first.delta.tool_calls
    assert call.index == 0 and call.function.name == "calculator" and call.function.arguments == '{"expression": "2+3"}'
    assert chunks[1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(model.prompts[0])
    # the SDK's stream helper assembles the same message a plain call returns
    assert assembled.choices[0].message.content == plain.choices[0].message.content == "It is \\boxed{5}."
    assert assembled.choices[0].finish_reason == "stop"
    assert len(log.calls) == 3 and len(model.prompts) == 3  # each streamed call generated and recorded once


# ---- verifiers:ID is the bridge agent --------------------------------------------------------------


def test_the_agent_job_hands_the_id_to_an_agent_that_names_env_id():
    job = AgentJob(target="tests.unit._env_id_agent:reports_env_id", base_url="http://127.0.0.1:9/v1", api_key="k",
                   model="m", prompt=[{"role": "user", "content": "hi"}], env_id="vf-arith", timeout_s=60)
    outcome = asyncio.run(run_agent(job))
    assert outcome.status == "ok" and outcome.reward == 1.0


def test_verifiers_id_runs_the_bridge_and_a_missing_verifiers_costs_only_the_episode(tokenizer):
    async def go():
        endpoint, model = serve(tokenizer)
        await endpoint.start()
        agents = AgentEpisodes(EnvConfig(name="verifiers:vf-arith", agent_timeout_s=60), endpoint, None, engine_id=0)
        try:
            prompt = Prompt(prompt_id=1, messages=[ChatMessage("user", "What is 2+3?")], answer="5")
            return agents, await agents.episode(prompt, "ep-0", SAMPLING), model
        finally:
            await endpoint.stop()

    agents, outcome, model = asyncio.run(go())
    assert (agents.target, agents.env_id) == (VERIFIERS_BRIDGE, "vf-arith")
    # this interpreter has no verifiers: the bridge ran and failed with one line; nothing generated
    assert outcome.status == REWARD_ERROR and outcome.reward == 0.0 and outcome.segments == []
    assert "No module named 'verifiers'" in agents.counters.last_error and agents.counters.errors == 1
    assert not model.prompts


def test_the_bridge_reward_is_the_traces_sum_and_a_failed_episode_raises_verifiers_first_error():
    ok = SimpleNamespace(ok=True, errors=[], traces=[SimpleNamespace(reward=1.0, errors=[]), SimpleNamespace(reward=0.5, errors=[])])
    assert episode_reward(ok) == 1.5
    error = SimpleNamespace(type="HarnessError", message="harness 'null' exited 1: boom\nTraceback ...")
    failed = SimpleNamespace(ok=False, errors=[], traces=[SimpleNamespace(reward=0.0, errors=[error])])
    with pytest.raises(RuntimeError, match="^verifiers episode failed: HarnessError: harness 'null' exited 1: boom$"):
        episode_reward(failed)


# ---- one-line errors -------------------------------------------------------------------------------


def test_ids_verifiers_cannot_resolve_are_refused_in_config_with_one_line():
    assert id_error("vf-arith") is None and id_error("primeintellect/gsm8k@0.1.2") is None
    for name, why in [("verifiers:", "names no environment"), ("verifiers:examples.vf_arith", "_import_plugin")]:
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"env.name='{name}'"])
        assert why in str(info.value) and "\n" not in str(info.value)
    assert load_config(None, ["env.name=verifiers:vf-arith"]).env.name == "verifiers:vf-arith"


def test_an_interpreter_without_verifiers_is_one_line_naming_it(tmp_path):
    with pytest.raises(ConfigError) as info:
        check_interpreter(sys.executable, "vf-arith")
    message = str(info.value)
    assert "\n" not in message and "does not import verifiers" in message and "No module named 'verifiers'" in message
    with pytest.raises(ConfigError, match="cannot run env.python"):
        check_interpreter(str(tmp_path / "no-python"), "vf-arith")


# ---- real verifiers episodes against the scripted model (needs a verifiers venv) -------------------


@pytest.fixture(scope="module")
def verifiers_venv():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", examples_pythonpath())
        why = unavailable()
        if why:
            pytest.skip(why)
        yield VF_PYTHON


def test_verifiers_episodes_score_our_prompt_or_the_tasksets_row_and_multi_turn_is_one_segment(tokenizer, verifiers_venv):
    async def episode(env_id: str, script: list[str], prompt: Prompt):
        endpoint, model = serve(tokenizer, script)
        await endpoint.start()
        cfg = EnvConfig(name=f"verifiers:{env_id}", python=verifiers_venv, agent_timeout_s=120)
        agents = AgentEpisodes(cfg, endpoint, None, engine_id=0)
        try:
            return await agents.episode(prompt, "ep", SAMPLING), agents.counters, model
        finally:
            await endpoint.stop()

    ours = Prompt(prompt_id=1, messages=[ChatMessage("user", "What is 17 + 25?")], answer="42")
    right, counters, _ = asyncio.run(episode("vf-arith", ["It is \\boxed{42}."], ours))
    assert (right.reward, right.status, counters.errors) == (1.0, REWARD_OK, 0), counters.last_error
    assert "What is 17 + 25?" in tokenizer.decode(right.segments[0].prompt_ids)
    row = Prompt(prompt_id=2, messages=[ChatMessage("user", "ignored")], answer="", metadata={"vf_idx": 1})
    wrong, _, _ = asyncio.run(episode("vf-arith", ["It is \\boxed{42}."], row))  # row 1: 9 * 8
    assert wrong.reward == 0.0 and "What is 9 * 8?" in tokenizer.decode(wrong.segments[0].prompt_ids)
    retried, counters, model = asyncio.run(episode("vf-arith-retry", ["\\boxed{41}", "\\boxed{42}"], ours))
    assert retried.reward == 1.0 and len(retried.segments) == 1 and len(model.prompts) == 2
    seg = retried.segments[0]  # both answers trained, the env's feedback between them masked
    assert seg.turn_versions == [0, 0] and sum(seg.loss_mask) == 2 * len(tokenizer.encode("\\boxed{41}") + [2])
    feedback = tokenizer.decode([t for t, m in zip(seg.completion_ids, seg.loss_mask, strict=True) if not m])
    assert "Check the arithmetic and answer again" in feedback
