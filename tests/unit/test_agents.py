"""Agents over the OpenAI-compatible endpoint: token-in/token-out episode records, segments and
prefix breaks, OpenAI tool calls, the key, and agents that hang or raise. The model behind the
endpoint is scripted here (no vLLM); tests/integration/test_agents_real.py serves the real one."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from async_rl.agents.episodes import AgentEpisodes
from async_rl.config import EnvConfig
from async_rl.endpoint.endpoint import CallSampling, ChatEndpoint, ModelBackend
from async_rl.endpoint.episode_log import CallRecord, Choice, build_segments
from async_rl.endpoint.rendering import ChatRenderer
from async_rl.protocol import (
    REWARD_ERROR,
    REWARD_OK,
    REWARD_TIMEOUT,
    ChatMessage,
    Prompt,
    Sample,
    decode_groups,
    encode_groups,
)
from async_rl.serving.sampling import SamplingSpec

KEY = "test-key"
SAMPLING = SamplingSpec(n=1, max_tokens=32, temperature=1.0, stop_token_ids=[2])


def choice(ids: list[int], version: int = 0, finish: str = "stop") -> Choice:
    return Choice(token_ids=ids, logprobs=[-0.5] * len(ids), text="", finish_reason=finish,
                  version_first=version, version_last=version)


class ScriptedModel(ModelBackend):
    """Answers with the next scripted text (then 'The answer is 5.'), ended by <|im_end|>."""

    def __init__(self, tokenizer, script: list[str] | None = None) -> None:
        self.tok = tokenizer
        self.script = list(script or [])
        self.model_name = "scripted"
        self.max_model_len = 2048
        self.prompts: list[list[int]] = []
        self.version = 0

    async def complete(self, prompt_ids: list[int], base: SamplingSpec, call: CallSampling, request_id: str,
                       images=None) -> list[Choice]:
        self.prompts.append(list(prompt_ids))
        out = []
        for _ in range(call.n):
            text = self.script.pop(0) if self.script else "The answer is 5."
            ids = self.tok.encode(text) + [2]
            out.append(Choice(token_ids=ids, logprobs=[-0.25] * len(ids), text=text, finish_reason="stop",
                              version_first=self.version, version_last=self.version))
        return out


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


def serve(tokenizer, script: list[str] | None = None) -> tuple[ChatEndpoint, ScriptedModel]:
    model = ScriptedModel(tokenizer, script)
    return ChatEndpoint(model, ChatRenderer(tokenizer, 2), KEY), model


# ---- segments ------------------------------------------------------------------------------------


def test_calls_that_extend_the_episode_make_one_segment_with_environment_tokens_masked():
    calls = [
        CallRecord(prompt_ids=[1, 10, 11], choices=[choice([20, 21, 2], version=3)]),
        CallRecord(prompt_ids=[1, 10, 11, 20, 21, 2, 30, 31], choices=[choice([40, 2], version=4)]),
    ]
    (seg,) = build_segments(calls)
    assert seg.prompt_ids == [1, 10, 11]
    assert seg.completion_ids == [20, 21, 2, 30, 31, 40, 2]
    assert seg.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert seg.logprobs == [-0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert seg.turn_versions == [3, 4] and seg.version_last == 4


def test_a_call_that_does_not_extend_the_episode_starts_a_new_segment():
    calls = [
        CallRecord(prompt_ids=[1, 10, 11], choices=[choice([20, 2])]),
        CallRecord(prompt_ids=[1, 10, 12, 20, 2, 30], choices=[choice([40, 2])]),  # history rewritten
        CallRecord(prompt_ids=[1, 10, 12, 20, 2, 30, 40, 2, 50], choices=[choice([60, 2])]),
    ]
    segs = build_segments(calls)
    assert len(segs) == 2  # one prefix break
    assert segs[0].tokens() == [1, 10, 11, 20, 2]
    assert segs[1].prompt_ids == [1, 10, 12, 20, 2, 30]  # exactly what the model saw, not re-tokenized
    assert segs[1].completion_ids == [40, 2, 50, 60, 2] and segs[1].loss_mask == [1, 1, 0, 1, 1]


def test_with_n_choices_the_episode_goes_on_with_the_one_the_next_call_extends():
    calls = [
        CallRecord(prompt_ids=[1, 10], choices=[choice([20, 2]), choice([21, 2])]),
        CallRecord(prompt_ids=[1, 10, 21, 2, 30], choices=[choice([40, 2])]),
    ]
    (seg,) = build_segments(calls)
    assert seg.completion_ids == [21, 2, 30, 40, 2] and seg.loss_mask == [1, 1, 0, 1, 1]


# ---- the endpoint --------------------------------------------------------------------------------


def run(coro):
    return asyncio.run(coro)


def test_a_caller_without_the_key_is_refused(tokenizer):
    async def go():
        endpoint, model = serve(tokenizer)
        await endpoint.start()
        endpoint.open_episode("ep", SAMPLING, 4)
        try:
            for key in ("wrong-key", ""):
                client = openai.AsyncOpenAI(base_url=endpoint.base_url("ep"), api_key=key or "x", max_retries=0)
                if not key:
                    client = openai.AsyncOpenAI(base_url=endpoint.base_url("ep"), api_key="x", max_retries=0,
                                                default_headers={"Authorization": ""})
                with pytest.raises(openai.AuthenticationError):
                    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert endpoint.refused == 2 and not model.prompts  # nothing was generated for them
            ok = openai.AsyncOpenAI(base_url=endpoint.base_url("ep"), api_key=KEY, max_retries=0)
            assert (await ok.models.list()).data[0].id == "scripted"
        finally:
            await endpoint.stop()

    run(go())


def test_tool_calls_come_back_in_the_openai_format_and_the_next_call_extends_the_tokens(tokenizer):
    tools = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                               "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    call_text = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'

    async def go():
        endpoint, model = serve(tokenizer, [call_text, "It is \\boxed{5}."])
        await endpoint.start()
        endpoint.open_episode("ep", SAMPLING, 4)
        try:
            client = openai.AsyncOpenAI(base_url=endpoint.base_url("ep"), api_key=KEY, max_retries=0)
            messages = [{"role": "user", "content": "What is 2+3?"}]
            first = (await client.chat.completions.create(model="m", messages=messages, tools=tools, logprobs=True)).choices[0]
            assert first.finish_reason == "tool_calls" and first.message.content is None
            (tc,) = first.message.tool_calls
            assert tc.type == "function" and tc.function.name == "calculator"
            assert json.loads(tc.function.arguments) == {"expression": "2+3"}
            assert [t.logprob for t in first.logprobs.content] == [-0.25] * len(first.logprobs.content)
            assert "calculator" in tokenizer.decode(model.prompts[0])  # the tools were described to the model
            messages += [first.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": tc.id, "content": "5"}]
            second = (await client.chat.completions.create(model="m", messages=messages, tools=tools)).choices[0]
            assert second.message.content == "It is \\boxed{5}." and not second.message.tool_calls
        finally:
            await endpoint.stop()
        return endpoint.close_episode("ep")

    log = run(go())
    (seg,) = build_segments(log.calls)  # spliced: the first reply's sampled ids, not its re-rendered text
    first_ids = tokenizer.encode(call_text) + [2]
    assert seg.completion_ids[: len(first_ids)] == first_ids
    env = [t for t, m in zip(seg.completion_ids, seg.loss_mask, strict=True) if m == 0]
    assert tokenizer.decode(env) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert sum(seg.loss_mask) == len(first_ids) + len(tokenizer.encode("It is \\boxed{5}.")) + 1


def test_requests_outside_an_open_episode_and_past_max_turns_are_refused(tokenizer):
    async def go():
        endpoint, _ = serve(tokenizer)
        await endpoint.start()
        endpoint.open_episode("ep", SAMPLING, 1)
        msgs = [{"role": "user", "content": "hi"}]
        try:
            stray = openai.AsyncOpenAI(base_url=endpoint.base_url("nope"), api_key=KEY, max_retries=0)
            with pytest.raises(openai.NotFoundError):
                await stray.chat.completions.create(model="m", messages=msgs)
            by_header = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{endpoint.port}/v1", api_key=KEY,
                                           max_retries=0, default_headers={"X-Episode-Id": "ep"})
            await by_header.chat.completions.create(model="m", messages=msgs)
            with pytest.raises(openai.RateLimitError):  # env.max_turns=1 call
                await by_header.chat.completions.create(model="m", messages=msgs)
            endpoint.open_episode("text", SAMPLING, 1)
            plain = openai.AsyncOpenAI(base_url=endpoint.base_url("text"), api_key=KEY, max_retries=0)
            done = await plain.completions.create(model="m", prompt="2+2=", max_tokens=4, logprobs=1)
            assert done.choices[0].text == "The answer is 5." and done.choices[0].logprobs.token_logprobs[0] == -0.25
            assert endpoint.close_episode("text").calls[0].prompt_ids == tokenizer.encode("2+2=")
        finally:
            await endpoint.stop()
        return endpoint.close_episode("ep")

    assert len(run(go()).calls) == 1


# ---- agents in their own processes ---------------------------------------------------------------


async def _score(sample: Sample) -> tuple[float, int]:
    return (1.0 if "5" in sample.completion else 0.0), REWARD_OK


def run_group_on(model: ScriptedModel, tokenizer, target: str, n: int, timeout_s: float = 60.0, max_concurrent: int = 16):
    async def go():
        endpoint = ChatEndpoint(model, ChatRenderer(tokenizer, 2), KEY)
        await endpoint.start()
        cfg = EnvConfig(name=f"agent:tests.unit._agents:{target}", agent_timeout_s=timeout_s,
                        max_concurrent_agents=max_concurrent)
        agents = AgentEpisodes(cfg, endpoint, _score, engine_id=0)
        try:
            prompt = Prompt(prompt_id=7, messages=[ChatMessage("user", "What is 2+3?")], answer="5")
            return await agents.run_group(prompt, "e0-r1-p7", SAMPLING, n, version=0), agents.stats()
        finally:
            await endpoint.stop()

    return run(go())


def run_group(tokenizer, target: str, n: int, timeout_s: float = 60.0, max_concurrent: int = 16):
    return run_group_on(ScriptedModel(tokenizer), tokenizer, target, n, timeout_s, max_concurrent)


def test_an_agent_episode_becomes_a_masked_sample_that_survives_the_wire(tokenizer):
    group, stats = run_group(tokenizer, "two_calls", 2)
    assert stats.episodes == 2 and stats.calls == 4 and stats.prefix_breaks == 0
    assert group.rewards == [1.0, 1.0] and group.reward_status == [REWARD_OK] * 2
    text = tokenizer.decode(list(group.prompt_tokens))
    assert text.endswith("What is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    for i in range(2):
        mask = group.loss_mask(i)
        assert [e.turns for e in group.episodes] == [2, 2] and mask.sum() == 2 * len(tokenizer.encode("The answer is 5.") + [2])
        env = tokenizer.decode([t for t, m in zip(group.completions[i], mask, strict=True) if not m])
        assert "<|im_start|>user\nAre you sure?<|im_end|>" in env
    _, (back,) = decode_groups(encode_groups("run", [group]), "run")
    assert [list(c) for c in back.completions] == [list(c) for c in group.completions]


class RecoveringModel(ScriptedModel):
    """Serves version 31 for the first call and 30 after it: a learner recovery synced its older
    checkpoint between the agent's two calls."""

    async def complete(self, prompt_ids: list[int], base: SamplingSpec, call: CallSampling, request_id: str,
                       images=None) -> list[Choice]:
        self.version = 31 if not self.prompts else 30
        return await super().complete(prompt_ids, base, call, request_id)


def test_an_agent_episode_across_a_learner_recovery_reports_its_lowest_and_highest_version(tokenizer):
    group, _ = run_group_on(RecoveringModel(tokenizer), tokenizer, "two_calls", 1)
    assert group.episodes[0].turn_versions == [31, 30]
    assert group.version_first == [30] and group.version_last == [31]
    _, (back,) = decode_groups(encode_groups("run", [group]), "run")  # the buffer's decoder takes it
    assert back.episodes == group.episodes and back.version_first == [30]


def test_an_agent_that_rewrites_history_gives_split_segments_counted(tokenizer):
    group, stats = run_group(tokenizer, "rewrites_history", 2)
    assert stats.prefix_breaks == 2 and stats.segments == 4 and group.episode_count == 2
    # both segments of each episode are trained; the second exactly as the model saw it
    for i in (1, 3):
        full = tokenizer.decode(list(group.prompt_tokens) + list(group.completions[i]))
        assert "Say it again, shorter." in full and "What is 2+3?" not in full
        assert group.episodes[i].turns == 1


@pytest.fixture(scope="module")
def split(tokenizer):
    """Three episodes of 1, 2 and 3 segments (0, 1, 2 prefix breaks), rewards 0, 0.5, 1, and what the
    scripted model was asked."""
    model = ScriptedModel(tokenizer)
    group, stats = run_group_on(model, tokenizer, "rewrites_per_episode", 3)
    return group, stats, model


def test_every_segment_of_a_split_episode_trains_exactly_what_the_model_saw(split, tokenizer):
    group, stats, model = split
    assert stats.prefix_breaks == 3 and stats.segments == 6 and stats.calls == 6
    assert group.episode_of == [0, 1, 1, 2, 2, 2] and group.episode_count == 3
    assert group.rewards == [0.0, 0.5, 0.5, 1.0, 1.0, 1.0]
    answer = tokenizer.encode("The answer is 5.") + [2]
    seen = []
    for i in range(group.size):
        mask = group.loss_mask(i)
        first = int(mask.argmax())  # the segment's one call: the rest of its prompt (masked), then the answer
        tokens = [int(t) for t in group.prompt_tokens] + [int(t) for t in group.completions[i]]
        seen.append(tokens[: len(group.prompt_tokens) + first])
        assert [int(t) for t in group.completions[i][first:]] == answer and mask[first:].all()
        assert list(group.logprobs[i]) == [0.0] * first + [-0.25] * len(answer)
        assert group.episodes[i].turns == 1 and group.version_first[i] == group.version_last[i] == 0
    assert sorted(seen) == sorted(model.prompts)  # each segment's prompt: one the model was given
    _, (back,) = decode_groups(encode_groups("run", [group]), "run")
    assert back.episode_of == group.episode_of
    assert [list(c) for c in back.completions] == [list(c) for c in group.completions]


def test_a_split_episode_counts_once_in_its_group_and_in_the_accounting(split):
    """GRPO/RLOO statistics over the group's 3 episodes (not its 6 segments), each segment with its
    episode's advantage; Dr.GRPO's constant counts episodes; the buffer accounts episodes, balanced."""
    import torch

    from async_rl.config import AlgorithmConfig
    from async_rl.learner.base import across_updates_count, episode_infos, episode_rewards
    from async_rl.learner.batch.padded import PaddedShard
    from async_rl.learner.rl.advantages import grpo_advantages, rloo_advantages
    from async_rl.learner.rl.algorithms import Algorithm

    group = decode_groups(encode_groups("run", [split[0]]), "run")[1][0]
    shard = PaddedShard([group])
    per_episode = torch.tensor([[0.0, 0.5, 1.0]])
    assert torch.equal(shard.rewards, per_episode)

    def prepare(name: str):
        algo = Algorithm(AlgorithmConfig(name=name), max_tokens=32, temperature=1.0, model_dir="",
                         dtype=torch.float32, hidden_size=0, seed=0, max_grad_norm=1.0)
        return algo.prepare(shard, policy=None, reduce=lambda x: x)

    for name, estimator in (("grpo", grpo_advantages), ("rloo", rloo_advantages)):
        want = estimator(per_episode)[0][torch.tensor(group.episode_of)]
        torch.testing.assert_close(prepare(name).advantages.reshape(-1), want)
    assert prepare("grpo").denominator == float(shard.loss_mask.sum())  # token mean over every segment
    assert prepare("dr_grpo").denominator == 3 * 32  # episodes x max_tokens
    assert episode_rewards([group]) == [0.0, 0.5, 1.0] and across_updates_count([group]) == 0
    assert [e.turns for e in episode_infos([group])] == [1, 2, 3]
    assert_buffer_accounts_episodes(group)


def assert_buffer_accounts_episodes(group) -> None:
    import collections
    import dataclasses

    from async_rl.buffer.ingest import Ingest
    from async_rl.buffer.leasing import Leases
    from async_rl.buffer.ledger import Ledger
    from async_rl.buffer.prompt_source import PromptSource
    from async_rl.buffer.serving import BatchServer
    from async_rl.config import DataConfig

    async def go():
        ledger = Ledger(max_lag=0, batch_samples=3, group_size=3)
        leases = Leases(ledger, PromptSource.from_settings("repeat", 0, "", 0, DataConfig()), 3)
        changed, rejected = asyncio.Condition(), collections.Counter()
        server = BatchServer("run", 1, 0, ledger, rejected, lambda: 0, changed)
        ingest = Ingest("run", 1 << 30, 3, False, ledger, leases, rejected, server.add, changed)
        (p,) = leases.grant(0, 1)
        assert ledger.accounts.leased == 3
        ingest.ingest_frame(encode_groups("run", [dataclasses.replace(group, prompt_id=p.prompt_id)]))
        assert not rejected and ledger.accounts.waiting == 3 and ledger.accounts.balanced()
        await server.build(0, 1)
        assert server.ack(0) == 3 and ledger.accounts.trained == 3 and ledger.accounts.balanced()
        # at version 3: a stale group is dropped as its 3 episodes, a group of 2 episodes (in 3
        # samples) is refused and its lease counted lost (3), a fresh one trains as 3 episodes
        ledger.generator_version = 3
        p2, p3, p4 = leases.grant(0, 3)
        rows = slice(0, 3)
        short = dataclasses.replace(
            group, prompt_id=p3.prompt_id, episode_of=group.episode_of[rows],
            **{f: getattr(group, f)[rows] for f in ("completions", "logprobs", "rewards", "version_first", "version_last",
                                                     "reward_status", "finish_reasons", "loss_masks", "episodes")},
        )
        fresh = dataclasses.replace(group, prompt_id=p4.prompt_id, version_first=[3] * 6, version_last=[3] * 6,
                                    episodes=None)
        for g in (dataclasses.replace(group, prompt_id=p2.prompt_id), short, fresh):
            ingest.ingest_frame(encode_groups("run", [g]))
        assert rejected == {"group_size": 1}
        (shard,) = await server.build(3, 1)
        assert shard[0].prompt_id == p4.prompt_id and server.ack(3) == 3
        a = ledger.accounts
        assert (a.leased, a.trained, a.dropped_stale, a.lost) == (12, 6, 3, 3) and a.balanced()
    run(go())

def test_an_agent_that_hangs_or_raises_costs_only_its_own_episode(tokenizer):
    # The hanging episode costs the whole timeout; the others must start their agent processes and
    # finish inside it, on a core the parallel suite shares (6 s timed out once there).
    group, stats = run_group(tokenizer, "flaky", 4, timeout_s=15.0)
    assert group.reward_status == [REWARD_TIMEOUT, REWARD_ERROR, REWARD_OK, REWARD_OK]
    assert group.rewards == [0.0, 0.0, 1.0, 1.0]
    assert stats.timeouts == 1 and stats.errors == 1 and stats.crashes == 0
    assert all(group.loss_mask(i).sum() > 0 for i in range(4))  # their calls before failing are kept


def most_at_once(windows: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in windows] + [(b, -1) for _, b in windows])
    running = peak = 0
    for _, d in edges:
        running += d
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize("bound", [2, 0])
def test_agent_processes_per_engine_are_bounded_by_max_concurrent_agents(tokenizer, tmp_path, monkeypatch, bound):
    monkeypatch.setenv("ASYNC_RL_TEST_WINDOWS", str(tmp_path))
    # Each agent holds its process 3 s after its call: with a bound of 2 the 6 episodes run in 3 waves.
    group, stats = run_group(tokenizer, "records_its_window", 6, max_concurrent=bound)
    assert group.reward_status == [REWARD_OK] * 6 and stats.timeouts == 0
    windows = [tuple(map(float, p.read_text().split())) for p in tmp_path.iterdir()]
    assert len(windows) == 6
    if bound:
        assert most_at_once(windows) <= bound
    else:
        assert most_at_once(windows) > 2  # no bound: they all start at once


def test_final_messages_are_scored_by_the_task_reward_and_async_agents_run(tokenizer):
    group, _ = run_group(tokenizer, "final_messages", 1)
    assert group.rewards == [1.0] and group.reward_status == [REWARD_OK]
    group, _ = run_group(tokenizer, "async_agent", 1)
    assert group.rewards == [1.0]


def test_a_malformed_agent_name_is_a_one_line_config_error():
    from async_rl.config import load_config
    from async_rl.errors import ConfigError

    for name in ("agent:pkg.module", "agent::fn", "agent:a:b:c"):
        with pytest.raises(ConfigError, match="is not 'agent:pkg.module:fn'"):
            load_config(None, [f"env.name={name}"])
    assert load_config(None, ["env.name=agent:examples.calculator_agent:solve"]).env.name.startswith("agent:")


def test_the_computed_frame_limit_allows_a_sequence_per_call_of_an_agent_episode():
    from async_rl.config import load_config
    from async_rl.control.settings import buffer_settings
    from async_rl.security import frame_limit_bytes

    sizes = ["generators.group_size=16", "generators.max_model_len=8192"]  # above 1 MiB: rounding shows
    plain = load_config(None, sizes)
    agent = load_config(None, [*sizes, "env.name=agent:examples.calculator_agent:solve", "env.max_turns=3"])
    g = agent.generators
    limit = buffer_settings(agent, "r", None, Path("m")).max_frame_bytes
    assert limit == frame_limit_bytes(0, 3 * g.group_size, g.max_model_len)
    assert limit > buffer_settings(plain, "r", None, Path("m")).max_frame_bytes


def test_a_template_that_knows_tools_gets_them_and_the_calls_natively(smollm2):
    from transformers import AutoTokenizer

    from async_rl.endpoint.openai_types import FunctionCall, FunctionSpec, Message, ToolCallOut, ToolSpec

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n"
        "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<tool_call>{{ c.function.name }}{{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    renderer = ChatRenderer(tok, 2)
    assert renderer.native_tools
    call = ToolCallOut(id="a", function=FunctionCall(name="calculator", arguments='{"expression": "1+1"}'))
    messages = [Message(role="user", content="hi"), Message(role="assistant", tool_calls=[call]),
                Message(role="tool", content="2", tool_call_id="a")]
    text = tok.decode(renderer.render(messages, [ToolSpec(function=FunctionSpec(name="calculator"))]))
    assert text.startswith("<|im_start|>system\nTOOLS:calculator <|im_end|>")
    assert '<|im_start|>assistant\n<tool_call>calculator{"expression": "1+1"}</tool_call><|im_end|>' in text
    assert text.endswith("<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n")


def test_the_calculator_agent_shows_its_worked_examples_as_tool_calls():
    """The data's examples call the calculator in the tag format; the agent (tools API) must turn them
    into tool_calls answered by tool messages, or the model imitates calls the endpoint never parses."""
    from examples.calculator_agent import as_tool_calls

    data = Path(__file__).resolve().parents[2] / "configs/data/tools_eval.jsonl"
    prompt = json.loads(data.read_text().splitlines()[0])["prompt"]
    messages = as_tool_calls(prompt)
    assert not any("<tool name=" in (m.get("content") or "") for m in messages)
    calls = [m for m in messages if m.get("tool_calls")]
    results = [m for m in messages if m["role"] == "tool"]
    assert len(calls) == len(results) == 2
    assert [c["tool_calls"][0]["id"] for c in calls] == [r["tool_call_id"] for r in results]
    assert json.loads(calls[0]["tool_calls"][0]["function"]["arguments"]) == {"expression": "123*45"}
    assert messages[-1] == prompt[-1]  # the question itself is untouched


def test_the_tagged_calculator_agent_asks_like_the_built_in_tool_environment():
    from async_rl.envs.tool_env import tool_instructions
    from async_rl.envs.tools import Calculator
    from examples.calculator_agent import with_tag_instructions

    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3?"}]
    messages = with_tag_instructions(prompt)
    assert messages[0]["content"] == "Be brief.\n\n" + tool_instructions([Calculator()], "tag")
    assert messages[1:] == prompt[1:] and prompt[0]["content"] == "Be brief."  # the caller's list untouched
