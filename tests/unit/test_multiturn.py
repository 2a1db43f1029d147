"""Multi-turn episodes end to end without vLLM: a scripted 3-turn episode through the wire and into the
learner's batch (environment tokens carry no loss), loss-mask validation on the wire, advantages over
masks with holes, the `env` config section and its factory, and the per-step episode metrics."""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import numpy as np
import pytest
import torch

from async_rl.config import AlgorithmConfig, Config, EnvConfig, load_config
from async_rl.envs.episode import ChatDelta, run_episode
from async_rl.envs.factory import build_environment, combined_system_prompt
from async_rl.envs.guess import GuessNumberEnvironment, GuessNumberTask, game_prompt
from async_rl.envs.tool_env import ToolEnvironment
from async_rl.errors import ConfigError
from async_rl.learner.base import StepMetrics
from async_rl.learner.batch.packing import packed
from async_rl.learner.batch.padded import PaddedShard
from async_rl.learner.driver import LearnerDriver, shard_samples
from async_rl.learner.rl.advantages import discounted_returns, gae, token_rewards
from async_rl.protocol import (
    ChatMessage,
    EpisodeInfo,
    FrameError,
    Prompt,
    TrajectoryGroup,
    decode_groups,
    encode_groups,
)
from tests.unit._learner_fixtures import settings
from tests.unit.test_envs import build_chat_tokenizer, render, scripted

RUN = "mt"


@pytest.fixture(scope="module")
def chat_tokenizer():
    return build_chat_tokenizer()


def three_turn_group(tok, group_size: int = 2) -> tuple[TrajectoryGroup, list]:
    """`group_size` scripted guess-the-number episodes of 3 turns (solved on the 3rd, or never)."""
    prompt = game_prompt(7, 1, 100, seed=0)
    secret = int(prompt.answer)
    prompt_ids = render(tok, prompt.messages, add_generation_prompt=True)
    results = []
    for i in range(group_size):
        last = str(secret) if i == 0 else str(secret + 1)
        generate, _ = scripted(tok, [str(secret - 10), str(secret + 5), last], logprob=-0.5 - 0.1 * i)
        results.append(
            asyncio.run(
                run_episode(
                    GuessNumberEnvironment().start(prompt),
                    prompt_ids,
                    list(prompt.messages),
                    generate,
                    ChatDelta(tok, tok.eos_token_id),
                    max_turns=3,
                    max_total_tokens=4096,
                )
            )
        )
    group = TrajectoryGroup(
        prompt_id=prompt.prompt_id,
        engine_id=0,
        prompt_tokens=np.asarray(prompt_ids, np.int32),
        completions=[np.asarray(r.completion_ids, np.int32) for r in results],
        logprobs=[np.asarray(r.logprobs, np.float32) for r in results],
        rewards=[r.reward for r in results],
        version_first=[r.turn_versions[0] for r in results],
        version_last=[r.turn_versions[-1] for r in results],
        reward_status=[0] * group_size,
        loss_masks=[np.asarray(r.loss_mask, np.uint8) for r in results],
        episodes=[EpisodeInfo(turns=r.turns, turn_versions=r.turn_versions) for r in results],
    )
    return group, results


def in_vocab(group: TrajectoryGroup, vocab: int) -> TrajectoryGroup:
    """The same episode with token ids folded into the tiny model's vocabulary (positions, masks and
    log-probs untouched: what the alignment checks are about)."""
    return dataclasses.replace(
        group,
        prompt_tokens=group.prompt_tokens % vocab,
        completions=[c % vocab for c in group.completions],
    )


# ---------------------------------------------------------------- wire


def test_episode_masks_and_logprobs_survive_the_wire(chat_tokenizer):
    group, results = three_turn_group(chat_tokenizer)
    assert [r.turns for r in results] == [3, 3] and results[0].reward > 0 and results[1].reward == 0
    _, (back,) = decode_groups(encode_groups(RUN, [group]), RUN)
    for i, r in enumerate(results):
        np.testing.assert_array_equal(back.loss_mask(i), r.loss_mask)
        np.testing.assert_array_equal(back.completions[i], r.completion_ids)
        np.testing.assert_array_equal(back.logprobs[i], np.asarray(r.logprobs, np.float32))
        assert back.loss_mask(i).min() == 0  # environment turns are in the completion
    assert [e.turns for e in back.episodes] == [3, 3]
    assert [e.turn_versions for e in back.episodes] == [r.turn_versions for r in results]
    assert back.version_first == [0, 0] and back.version_last == [2, 2]
    assert back.oldest_version == 0  # the buffer's staleness: the oldest first turn of the group


def test_single_turn_groups_carry_no_mask():
    g = TrajectoryGroup(0, 0, np.array([1, 2], np.int32), [np.array([3, 4], np.int32)], [np.array([-1, -1], np.float32)],
                        [1.0], [0], [0], [0])
    _, (back,) = decode_groups(encode_groups(RUN, [g]), RUN)
    assert back.loss_masks is None and back.episodes is None
    np.testing.assert_array_equal(back.loss_mask(0), [1, 1])


@pytest.mark.parametrize(
    ("mask", "why"),
    [([1, 0], "loss mask of 2 for 3 tokens"), ([1, 2, 0], "must be 0 or 1"), ([0, 0, 0], "no model token")],
)
def test_bad_loss_masks_are_rejected_naming_the_prompt(mask, why):
    g = TrajectoryGroup(42, 1, np.array([1], np.int32), [np.array([3, 4, 5], np.int32)],
                        [np.zeros(3, np.float32)], [0.0], [0], [0], [0], loss_masks=[np.asarray(mask, np.uint8)])
    with pytest.raises(FrameError) as info:
        decode_groups(encode_groups(RUN, [g]), RUN)
    assert info.value.reason == "bad_mask" and "prompt 42" in str(info.value) and why in str(info.value)
    assert info.value.header is not None  # the buffer can release (count lost) the prompt it names


@pytest.mark.parametrize(
    ("versions", "first", "last"),
    [([1, 2], 1, 2), ([1, 1, 2], 0, 2), ([2, 1, 2], 2, 2), ([0, 1, 3], 0, 2)],
    ids=["a turn missing", "lowest is not version_first", "lowest below version_first", "after version_last"],
)
def test_turn_versions_that_contradict_the_sample_are_rejected(versions, first, last):
    ep = EpisodeInfo(turns=3, turn_versions=versions)
    g = TrajectoryGroup(7, 1, np.array([1], np.int32), [np.array([3, 4, 5], np.int32)], [np.zeros(3, np.float32)],
                        [0.0], [first], [last], [0], loss_masks=[np.asarray([1, 0, 1], np.uint8)], episodes=[ep])
    with pytest.raises(FrameError) as info:
        decode_groups(encode_groups(RUN, [g]), RUN)
    assert info.value.reason == "bad_episode" and "prompt 7" in str(info.value) and "\n" not in str(info.value)


def test_turn_versions_that_go_down_after_a_learner_recovery_are_taken():
    """A learner recovery syncs an older checkpoint (version 30 after 31): the turns after it run on the
    lower version. Once rejected as `bad_episode` (the turns had to be non-decreasing, the first one
    version_first), which lost the episode's group."""
    ep = EpisodeInfo(turns=3, turn_versions=[31, 30, 30])
    g = TrajectoryGroup(7, 1, np.array([1], np.int32), [np.array([3, 4, 5], np.int32)], [np.zeros(3, np.float32)],
                        [0.0], [30], [31], [0], loss_masks=[np.asarray([1, 0, 1], np.uint8)], episodes=[ep])
    _, (back,) = decode_groups(encode_groups(RUN, [g]), RUN)
    assert back.episodes == [ep] and back.version_first == [30] and back.version_last == [31]


# ---------------------------------------------------------------- learner batch


def test_environment_tokens_have_zero_weight_in_the_trained_batch(chat_tokenizer, model_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    group, results = three_turn_group(chat_tokenizer)
    group = in_vocab(group, vocab)
    shard = PaddedShard([group])
    # The padded rows the algorithm prepares on: the mask is the episode's, shifted to target positions.
    for i, r in enumerate(results):
        start = len(group.prompt_tokens) - 1
        np.testing.assert_array_equal(shard.loss_mask[i, start : start + len(r.loss_mask)].numpy(), r.loss_mask)
        assert shard.loss_mask[i, :start].sum() == 0 and shard.loss_mask[i, start + len(r.loss_mask) :].sum() == 0
    # The packed micro-batch the backend trains on: weight 0 on environment tokens, behaviour log-probs
    # of the model's tokens exactly where the model's tokens are.
    rank = LearnerDriver(settings(model_dir), 0, 1, "", [])
    rank.setup()
    prepared = rank.algo.prepare(shard, lambda h: rank._score_padded(shard, h))
    mb = packed(shard_samples([group], prepared))
    for (row, col, n), r in zip(mb.spans, results, strict=True):
        np.testing.assert_array_equal(mb.loss_mask[row, col : col + n].numpy(), r.loss_mask)
        model = np.asarray(r.loss_mask, bool)
        np.testing.assert_array_equal(mb.behav_logp[row, col : col + n].numpy()[model], np.asarray(r.logprobs, np.float32)[model])
    assert mb.loss_tokens == sum(sum(r.loss_mask) for r in results)
    assert prepared.denominator == mb.loss_tokens  # the token mean counts the model's tokens only


def test_environment_tokens_change_neither_loss_nor_gradient(chat_tokenizer, model_dir):
    """Perturbing the behaviour log-probs of environment tokens leaves
    the step's loss, gradient and vLLM-vs-learner mismatch metrics unchanged; perturbing a model
    token's changes them (the check can fail)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    group, _ = three_turn_group(chat_tokenizer)
    group = in_vocab(group, vocab)

    def perturbed(on_env: bool) -> TrajectoryGroup:
        lps = []
        for i, lp in enumerate(group.logprobs):
            where = group.loss_mask(i) == (0 if on_env else 1)
            lps.append(np.where(where, lp - 5.0, lp).astype(np.float32))
        return dataclasses.replace(group, logprobs=lps)

    def step(g: TrajectoryGroup) -> StepMetrics:
        rank = LearnerDriver(settings(model_dir, algorithm=AlgorithmConfig(name="reinforce_pp")), 0, 1, "", [])
        rank.setup()
        return rank.train_on_shard(0, [g])

    base, env_changed, model_changed = step(group), step(perturbed(True)), step(perturbed(False))
    for field in ("loss", "grad_norm", "kl_behav", "logprob_abs_diff", "entropy"):
        assert getattr(env_changed, field) == pytest.approx(getattr(base, field), rel=1e-6, abs=1e-9), field
    assert abs(model_changed.logprob_abs_diff - base.logprob_abs_diff) > 1.0
    assert model_changed.loss != pytest.approx(base.loss, rel=1e-3)
    assert base.env_tokens == sum(int((group.loss_mask(i) == 0).sum()) for i in range(group.size)) > 0
    assert [e.turns for e in base.episodes] == [3, 3]


def test_probe_scores_model_tokens_only(chat_tokenizer, model_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    group, results = three_turn_group(chat_tokenizer)
    group = in_vocab(group, vocab)
    rank = LearnerDriver(settings(model_dir), 0, 1, "", [])
    rank.setup()
    rank.train_on_shard(0, [group])
    probe = rank.probe_logprobs(2)
    for positions, lps, r in zip(probe.positions, probe.logprobs, results, strict=True):
        start = len(group.prompt_tokens)
        assert positions == [start + i for i, m in enumerate(r.loss_mask) if m]
        assert len(lps) == len(positions)


# ---------------------------------------------------------------- advantages with holes


def test_reward_lands_on_the_last_model_token_and_returns_skip_environment_tokens():
    # completion: 2 model tokens, 2 environment tokens, 2 model tokens, then padding
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.float32)
    r = token_rewards(torch.tensor([1.0]), mask)
    assert r.tolist() == [[0, 0, 0, 0, 0, 0, 1, 0]]
    g = discounted_returns(r, mask, gamma=0.5)
    # model tokens in order get 0.125, 0.25, 0.5, 1 (one discount step per model token, none per hole)
    assert g.tolist() == [[0, 0.125, 0.25, 0, 0, 0.5, 1.0, 0]]


def test_gae_with_holes_equals_gae_on_the_model_tokens_alone():
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1, 0, 1]], dtype=torch.float32)
    rewards = torch.randn(1, 10, generator=gen) * mask
    values = torch.randn(1, 10, generator=gen)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    keep = mask[0].bool()
    dense_adv, dense_ret = gae(rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum())), 0.9, 0.8)
    torch.testing.assert_close(adv[:, keep], dense_adv)
    torch.testing.assert_close(ret[:, keep], dense_ret)
    assert adv[:, ~keep].abs().sum() == 0 and ret[:, ~keep].abs().sum() == 0


# ---------------------------------------------------------------- config and factory


def test_env_config_defaults_and_yaml(tmp_path):
    assert Config().env.name == ""  # single-turn unless asked
    path = tmp_path / "c.yaml"
    path.write_text("env:\n  name: tools\n  tools: [calculator, python]\n  tool_format: hermes\n  max_turns: 3\n")
    e = load_config(path).env
    assert (e.name, e.tools, e.tool_format, e.max_turns, e.max_total_tokens) == ("tools", ["calculator", "python"], "hermes", 3, 0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["env.name=chess"], "env.name 'chess' is not a built-in environment"),
        (["env.name=tools", "env.tools=[calculator, web]"], "env.tools"),
        (["env.name=tools", "env.tools=[]"], "empty env.tools"),
        (["env.name=guess", "env.max_total_tokens=99999"], "above generators.max_model_len"),
        (["env.name=guess", "generators.ignore_eos=true"], "ignore_eos"),
        (["env.name=guess", "algorithm.overlong=penalty", "algorithm.overlong_buffer_tokens=4"], "overlong=penalty"),
        (["env.name='verifiers:'"], "names no environment"),
    ],
)
def test_env_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_factory_builds_the_named_environments():
    assert build_environment(EnvConfig(), lambda s: 0.0) is None
    tools = build_environment(EnvConfig(name="tools", tools=["calculator", "python"], sandbox_wall_s=1.5), lambda s: 0.0)
    assert isinstance(tools, ToolEnvironment) and sorted(tools.tools) == ["calculator", "python"]
    assert tools.tools["python"].limits.wall_s == 1.5
    assert isinstance(build_environment(EnvConfig(name="guess"), lambda s: 0.0), GuessNumberEnvironment)
    shaped = build_environment(EnvConfig(name="tools", call_bonus=0.2), lambda s: 0.0)
    episode = shaped.start(Prompt(prompt_id=0, text="12*7?"))
    first = asyncio.run(episode.step('<tool name="calculator">12*7</tool>', finished=True))
    again = asyncio.run(episode.step('<tool name="calculator">1+1</tool>', finished=True))
    assert (first.reward, again.reward) == (0.2, None)  # env.call_bonus reaches the episode, paid once
    custom = build_environment(EnvConfig(name="tests.unit.test_multiturn:make_guess"), lambda s: 0.0)
    assert isinstance(custom, GuessNumberEnvironment) and custom.turn_penalty == 0.5
    with pytest.raises(ConfigError, match="not an async_rl Environment"):
        build_environment(EnvConfig(name="tests.unit.test_multiturn:not_an_env"), lambda s: 0.0)


def make_guess(cfg: EnvConfig, reward) -> GuessNumberEnvironment:
    return GuessNumberEnvironment(turn_penalty=0.5)


def not_an_env(cfg: EnvConfig, reward) -> int:
    return 3


def test_verifiers_environment_is_imported_lazily_with_a_clear_error(monkeypatch):
    import importlib

    real = importlib.import_module

    def missing(name, *a, **kw):
        if name == "async_rl.envs.verifiers_env":
            raise ModuleNotFoundError("No module named 'async_rl.envs.verifiers_env'")
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(ConfigError, match="env.name 'verifiers:wordle': verifiers environments are not available"):
        build_environment(EnvConfig(name="verifiers:wordle"), lambda s: 0.0)


def test_environment_instructions_are_in_the_rendered_prompt(model_dir):
    from async_rl.control.settings import with_env_system_prompt
    from async_rl.data import make_renderer

    cfg = load_config(None, ["env.name=tools", "data.system_prompt=Be brief."])
    text = combined_system_prompt(cfg.data.system_prompt, cfg.env)
    assert text.startswith("Be brief.\n\nYou can use these tools:") and '<tool name="NAME">' in text
    assert with_env_system_prompt(cfg.data, cfg).system_prompt == text  # what the buffer renders with
    assert combined_system_prompt("", EnvConfig()) == ""  # single-turn: unchanged
    renderer = make_renderer(cfg, model_dir)
    chat = renderer.messages_of(GuessNumberTask().prompts(0).__next__())
    assert chat[0].role == "system" and chat[0].content == text


def test_guess_task_prompts_and_reward():
    p = next(iter(GuessNumberTask().prompts(3)))
    assert 1 <= int(p.answer) <= 100 and p.prompt_id == 0
    from async_rl.protocol import Sample

    assert GuessNumberTask().reward(Sample(prompt=p, completion=f"I guess {p.answer}")) == 1.0


# ---------------------------------------------------------------- metrics


def test_episode_metrics_of_a_step():
    from async_rl.control.controller import episode_stats

    def rank(eps, env_tokens, lens):
        return StepMetrics(step=0, rank=0, loss=0, reward_mean=0, kl_behav=0, logprob_abs_diff=0, grad_norm=0,
                           clip_frac=0, tis_frac=0, samples=len(eps), tokens=0, wait_s=0, compute_s=0,
                           episodes=eps, env_tokens=env_tokens, completion_lens=lens)

    st = episode_stats([
        rank([EpisodeInfo(turns=3, tool_calls=2, tool_errors=1, tool_timeouts=1, tool_ok=1), EpisodeInfo(turns=1)],
             30, [60, 40]),
        rank([EpisodeInfo(turns=2, tool_calls=1, tool_ok=1)], 10, [100]),
    ])
    assert (st.turns_mean, st.turns_max, st.sandbox_timeouts) == (2.0, 3, 1)
    assert st.tool_calls_per_episode == 1.0 and st.tool_errors_per_episode == pytest.approx(1 / 3)
    assert st.env_token_share == pytest.approx(40 / 200)
    assert st.tool_success == pytest.approx(2 / 3)  # 2 calls ran ok of 3 attempts (1 timed out)
    assert episode_stats([rank([], 0, [5])]).turns_max == 0  # single-turn: all zero


# ---------------------------------------------------------------- the engine's episode loop


def episode_engine(tok, env: str, group_size: int, max_tokens: int, task=None, reward_timeout_s: float = 1.0,
                   reward_workers: int = 1, reward=None):
    """A GeneratorEngine for `env` that runs episodes without a vLLM engine (the test patches
    vc.generate): the chat delta of `tok`, sampling to `max_tokens` and the engine running. The
    environment's reward is `reward`, or else the engine's reward workers (which the test closes)."""
    from async_rl.config import TaskConfig
    from async_rl.generator.engine import EngineSettings, GeneratorEngine
    from async_rl.generator.rewards import RewardRunner
    from async_rl.serving import vllm_compat as vc
    from async_rl.serving.sampling import SamplingSpec

    task = task or TaskConfig()
    spec = vc.EngineSpec(model_dir="unused", dtype="float32", tensor_parallel_size=1, max_model_len=4096,
                         gpu_memory_utilization=0.5, seed=0, max_num_seqs=1)
    s = EngineSettings(engine_id=0, run_id=RUN, spec=spec, cores=[], group_size=group_size,
                       max_tokens=max_tokens, temperature=1.0, max_inflight_prompts=1, pause_mode="keep", task=task,
                       reward_timeout_s=reward_timeout_s, reward_workers=reward_workers, ingest_address="",
                       env=EnvConfig(name=env))
    # What GeneratorEngine.start sets up from the model folder and vLLM, here without them.
    from async_rl.generator.env_rollout import EnvironmentEpisodes

    eng = GeneratorEngine(s, buffer=None)
    if reward is None:
        eng.rewards = RewardRunner(task, reward_timeout_s, reward_workers)
    eng.sampling = SamplingSpec(n=1, max_tokens=max_tokens, temperature=1.0, stop_token_ids=[tok.eos_token_id])
    eng.rollout = EnvironmentEpisodes(eng.model, s.env, ChatDelta(tok, tok.eos_token_id), getattr(eng, "rewards", None),
                                      0, eng.sampling, reward)
    eng.model.open()
    return eng


@pytest.mark.parametrize(("before", "after"), [(0, 1), (31, 30)], ids=["update", "learner recovery"])
def test_engine_episode_waits_out_a_pause_between_turns(chat_tokenizer, monkeypatch, before, after):
    """A weight update after the first turn: the second turn does not start while the engine is
    paused, and starts on the new version once it resumes. The group records the lower of the turns'
    versions as version_first and the higher as version_last (after a learner recovery's sync of an
    older checkpoint the second turn's is the lower), and the buffer's decoder takes the frame; the
    mask marks the game's answers."""
    from async_rl.generator import rollout as engine_mod  # the wire codes an episode finishes with
    from async_rl.serving import vllm_compat as vc

    tok = chat_tokenizer
    eos = tok.eos_token_id
    prompt = game_prompt(5, 1, 100, seed=0)
    prompt = msgspec.structs.replace(prompt, token_ids=render(tok, prompt.messages, add_generation_prompt=True))
    secret = int(prompt.answer)
    started: list[tuple[str, int, list[int]]] = []

    async def scenario():
        eng = episode_engine(tok, "guess", group_size=1, max_tokens=8, reward=lambda sample: 0.0)

        async def generate(llm, source, params, request_id, images=None):
            started.append((request_id, eng.version, list(source["prompt_token_ids"])))
            if len(started) == 1:
                eng.model.hold()  # the controller pauses the engine right after the first turn
            text = str(secret - 1) if len(started) == 1 else str(secret)
            ids = tok.encode(text, add_special_tokens=False) + [eos]
            return list(source["prompt_token_ids"]), [vc.Completion(ids, [-0.25] * len(ids), text, "stop")]

        async def no_op(*args, **kwargs):
            return None

        monkeypatch.setattr(vc, "generate", generate)
        monkeypatch.setattr(vc, "resume", no_op)
        await eng.resume(before)  # the weights the first turn runs on
        task = asyncio.create_task(eng.rollout.group(prompt, "r1", eng.sampling, 1))
        for _ in range(50):  # every ready callback runs: the episode reaches its second turn's wait
            await asyncio.sleep(0)
        assert len(started) == 1 and not task.done()  # paused: the second turn has not started
        await eng.resume(after)
        return await task

    group = asyncio.run(scenario())
    low, high = min(before, after), max(before, after)
    assert [(rid, v) for rid, v, _ in started] == [("r1-s0-t1", before), ("r1-s0-t2", after)]
    assert group.version_first == [low] and group.version_last == [high] and group.oldest_version == low
    assert group.episodes == [EpisodeInfo(turns=2, turn_versions=[before, after])]
    assert group.rewards == [pytest.approx(0.9)]
    _, (decoded,) = decode_groups(encode_groups(RUN, [group]), RUN)
    assert decoded.episodes == group.episodes and decoded.version_first == [low]
    assert group.finish_reasons == [engine_mod.FINISH_STOP]
    full = list(group.prompt_tokens) + list(group.completions[0])
    assert full[: len(started[1][2])] == started[1][2]  # turn 2 generated from the kept tokens
    env_text = tok.decode([t for t, m in zip(group.completions[0], group.loss_mask(0), strict=True) if not m])
    assert "lower" in env_text or "higher" in env_text


def test_engine_tool_episodes_score_the_final_answer_in_the_reward_workers(chat_tokenizer, monkeypatch):
    """Two tool episodes of one prompt: each calls the calculator, sees its result, then answers. The
    final answer is scored by task.reward in the engine's reward worker processes; a reward that
    raises marks its own episode (REWARD_ERROR, reward 0) and not its sibling."""
    from async_rl.config import TaskConfig
    from async_rl.evaluation.scores import EvalParams
    from async_rl.protocol import REWARD_ERROR, REWARD_OK
    from async_rl.serving import vllm_compat as vc

    tok = chat_tokenizer
    eos = tok.eos_token_id
    messages = [ChatMessage("user", "What is 12 * 7?")]
    prompt = Prompt(prompt_id=3, messages=messages, token_ids=render(tok, messages, add_generation_prompt=True))
    task = TaskConfig(reward="tests.unit._tool_reward:reward")
    turns = {"s0": ['<tool name="calculator">12*7</tool>', "84"], "s1": ['<tool name="calculator">12*7</tool>', "85"]}
    seen: list[list[int]] = []

    async def scenario():
        eng = episode_engine(tok, "tools", group_size=2, max_tokens=16, task=task, reward_timeout_s=10.0,
                             reward_workers=2)

        async def generate(llm, source, params, request_id, images=None):
            episode, turn = request_id.split("-")[-2:]  # r1-s0-t1
            ids_in = list(source["prompt_token_ids"])
            seen.append(ids_in)
            text = turns[episode][int(turn[1:]) - 1]
            ids = tok.encode(text, add_special_tokens=False) + [eos]
            return ids_in, [vc.Completion(ids, [-0.5] * len(ids), text, "stop")]

        monkeypatch.setattr(vc, "generate", generate)
        try:
            group = await eng.rollout.group(prompt, "r1", eng.sampling, 2)
            # evaluation runs whole episodes too, scored the same way (n=2: the same two scripts)
            evaluated = await eng.evaluate([prompt], EvalParams(n=2, temperature=0.7, max_tokens=16))
            return group, evaluated
        finally:
            eng.rewards.close()

    group, evaluated = asyncio.run(scenario())
    (result,) = evaluated.results
    assert result.rewards == [1.0, 0.0] and result.reward_failures == 1 and evaluated.failed_prompts == 0
    assert result.completion_lens == [len(c) for c in group.completions]
    assert group.rewards == [1.0, 0.0] and group.reward_status == [REWARD_OK, REWARD_ERROR]
    assert [(e.turns, e.tool_calls, e.tool_ok, e.tool_errors) for e in group.episodes] == [(2, 1, 1, 0)] * 2
    for i in range(2):  # the calculator's answer is an environment turn: masked out of the loss
        env_text = tok.decode([t for t, m in zip(group.completions[i], group.loss_mask(i), strict=True) if not m])
        assert "calculator: 84" in env_text
    assert any("calculator: 84" in tok.decode(ids) for ids in seen)  # the second turn was generated after it
