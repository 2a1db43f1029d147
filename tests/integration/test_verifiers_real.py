"""verifiers 0.4 environments through a real engine's endpoint (smollm2-135m, one vLLM engine in this
process): `verifiers:vf-arith` (single-turn) and `verifiers:vf-arith-retry` (multi-turn) episodes run
by the bridge agent in a verifiers venv give a reward and recorded, trainable tokens.

Needs a venv with verifiers 0.4 and uv (`make verifiers-venv`, or ASYNC_RL_VERIFIERS_PYTHON naming
its interpreter); skipped with the reason otherwise. The example tasksets are put on the agents'
PYTHONPATH (examples/vf_arith), so they need not be installed in that venv.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from async_rl.agents.episodes import AgentEpisodes
from async_rl.config import EnvConfig
from async_rl.endpoint.endpoint import ChatEndpoint, ServedModelBackend
from async_rl.endpoint.rendering import ChatRenderer
from async_rl.protocol import REWARD_OK, ChatMessage, Prompt
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel
from async_rl.serving.sampling import SamplingSpec
from tests.integration._real_run import smollm2_dir
from tests.unit._verifiers_venv import VF_PYTHON, examples_pythonpath, unavailable

pytestmark = pytest.mark.integration

PROMPT = Prompt(prompt_id=3, messages=[ChatMessage("user", "What is 17 + 25? Answer with the number in \\boxed{}.")],
                answer="42")
SAMPLING = SamplingSpec(n=1, max_tokens=96, temperature=1.0, stop_token_ids=[2])


@pytest.fixture(scope="module")
def engine_endpoint():
    """One smollm2 engine and its endpoint for the module; the example tasksets on the agents' path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", examples_pythonpath())
        why = unavailable()
        if why:
            pytest.skip(why)
        from transformers import AutoTokenizer

        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        model_dir = smollm2_dir()
        spec = vc.EngineSpec(model_dir=model_dir, dtype="float32", tensor_parallel_size=1, max_model_len=512,
                             gpu_memory_utilization=0.5, seed=0, max_num_seqs=8)
        model = ServedModel(spec)
        tok = AutoTokenizer.from_pretrained(model_dir)
        loop = asyncio.new_event_loop()
        loop.run_until_complete(model.start())
        model.open()
        endpoint = ChatEndpoint(ServedModelBackend(model, "smollm2", 512), ChatRenderer.for_model(tok, [2], "test"), "k")
        loop.run_until_complete(endpoint.start())
        try:
            yield loop, endpoint, tok
        finally:
            loop.run_until_complete(endpoint.stop())
            loop.close()
            model.shutdown()


async def _score(sample) -> tuple[float, int]:
    raise AssertionError("a verifiers episode returns its own reward")


def _group(engine_endpoint, env_id: str, n: int):
    loop, endpoint, _ = engine_endpoint
    agents = AgentEpisodes(EnvConfig(name=f"verifiers:{env_id}", python=VF_PYTHON, agent_timeout_s=240, max_turns=4),
                           endpoint, _score, engine_id=0)
    before = endpoint.calls  # the endpoint is the module's: count this group's calls only
    group = loop.run_until_complete(agents.run_group(PROMPT, f"vf-{env_id}", SAMPLING, n, version=0))
    stats = agents.stats()
    return group, msgspec.structs.replace(stats, calls=stats.calls - before)


def test_a_single_turn_verifiers_episode_gets_a_reward_and_trainable_tokens(engine_endpoint):
    _, _, tok = engine_endpoint
    group, stats = _group(engine_endpoint, "vf-arith", 2)
    assert group.reward_status == [REWARD_OK, REWARD_OK], stats.last_error
    assert all(r in (0.0, 1.0) for r in group.rewards)
    assert stats.episodes == 2 and stats.calls == 2 and stats.prefix_breaks == 0
    assert "What is 17 + 25?" in tok.decode(list(group.prompt_tokens))
    for i in range(2):
        mask = group.loss_mask(i)
        assert mask.sum() > 0 and group.episodes[i].turns == 1
        sampled = [t for t, m in zip(group.completions[i], mask, strict=True) if m]
        assert (group.logprobs[i][mask.astype(bool)] < 0).all() and len(sampled) == mask.sum()


def test_a_multi_turn_verifiers_episode_trains_its_turns_with_the_feedback_masked(engine_endpoint):
    _, _, tok = engine_endpoint
    group, stats = _group(engine_endpoint, "vf-arith-retry", 2)
    # A retry whose history the chat template renders other than the model saw it splits its episode
    # into two trained samples (a prefix break): 2 episodes in 2 or more samples, every one scored.
    assert group.episode_count == 2 and group.reward_status == [REWARD_OK] * group.size, stats.last_error
    # one call per episode, two where the first answer was wrong (the env's feedback, another try)
    rewards = {e: group.rewards[i] for i, e in enumerate(group.episode_index())}
    assert stats.calls == sum(1 if r == 1.0 else 2 for r in rewards.values())
    for i in range(group.size):
        env_text = tok.decode([t for t, m in zip(group.completions[i], group.loss_mask(i), strict=True) if not m])
        if group.episodes[i].turns == 2:  # both answers trained, the feedback between them masked
            assert "Check the arithmetic and answer again" in env_text
    assert sum(e.turns for e in group.episodes) == stats.calls  # every call trained, in one segment or several
    assert stats.segments == len(group.episodes)
