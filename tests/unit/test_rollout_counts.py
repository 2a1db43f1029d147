"""The rollout kinds behind one interface: the engine's kind is chosen from env.name alone, and what
each kind counts reaches the step record (metrics.jsonl) and the console line."""

from __future__ import annotations

from async_rl.agents.episodes import AgentCounters
from async_rl.config import EnvConfig
from async_rl.control.controller import add_rollout_counts
from async_rl.control.metrics import StepRecord, console_line
from async_rl.generator.engine import EngineStats
from async_rl.generator.rollout import AGENT, ENVIRONMENT, SINGLE_TURN, RolloutCounters
from async_rl.generator.rollout_choice import make_rollout
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel
from async_rl.serving.sampling import SamplingSpec

SPEC = vc.EngineSpec(model_dir="unused", dtype="float32", tensor_parallel_size=1, max_model_len=64,
                     gpu_memory_utilization=0.5, seed=0, max_num_seqs=1)


def record() -> StepRecord:
    return StepRecord(step=0, version=1, elapsed_s=0, reward_mean=0, loss=0, kl_behav=0, logprob_abs_diff=0,
                      logprob_mismatch=None, grad_norm=0, clip_frac=0, tis_frac=0, samples_per_s=0, tokens_per_s=0,
                      learner_wait_s=0, learner_compute_s=0, sync_s=0, generator_version=0, buffer_waiting_groups=0,
                      lag_max=0, lag_mean=0, leased=0, in_flight=0, waiting=0, trained=0, dropped_stale=0, filtered=0,
                      lost=0, accounting_balanced=True, rejected_frames=0, reward_errors=0, reward_timeouts=0)


def engine(i: int, rollout: RolloutCounters | None) -> EngineStats:
    return EngineStats(engine_id=i, version=0, groups_pushed=0, samples_pushed=0, tokens_generated=0, inflight=0,
                       paused=False, idle_s=0.0, failed_requests=0, last_error="", rollout=rollout)


def test_the_rollout_kind_is_chosen_from_env_name():
    model, sampling = ServedModel(SPEC), SamplingSpec(n=2, max_tokens=8, temperature=1.0)
    kinds = {name: make_rollout(model, EnvConfig(name=name), None, 0, sampling, "127.0.0.1").counters().kind
             for name in ("", "agent:pkg.mod:fn", "verifiers:vf-arith")}
    assert kinds == {"": SINGLE_TURN, "agent:pkg.mod:fn": AGENT, "verifiers:vf-arith": AGENT}


def test_agent_counters_reach_the_step_record_and_the_console():
    a0 = AgentCounters(episodes=4, calls=9, prefix_breaks=2, segments=6, errors=1, timeouts=0, crashes=1, refused=3)
    a1 = AgentCounters(episodes=2, calls=3, prefix_breaks=0, segments=2, errors=0, timeouts=2, crashes=0)
    r = record()
    add_rollout_counts(r, [engine(0, RolloutCounters(AGENT, episodes=4, agents=a0)),
                           engine(1, RolloutCounters(AGENT, episodes=2, agents=a1)), engine(2, None)])
    got = (r.rollout_episodes, r.agent_calls, r.agent_prefix_breaks, r.agent_segments, r.agent_errors,
           r.agent_timeouts, r.agent_crashes, r.agent_refused)
    assert got == (6, 12, 2, 8, 1, 2, 1, 3)
    assert "agent calls 12 prefix breaks 2 failed 1/2/1" in console_line(r, 10)


def test_environment_episodes_count_without_agent_fields():
    r = record()
    add_rollout_counts(r, [engine(0, RolloutCounters(ENVIRONMENT, episodes=5, model_turns=11))])
    assert r.rollout_episodes == 5 and r.agent_calls == 0
    assert "agent calls" not in console_line(r, 10)
