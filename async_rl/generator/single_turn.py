"""Single-turn sampling: one request for `n` completions of the prompt, each scored by the task's
reward in the reward worker processes."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np

from async_rl.evaluation.scores import EvalParams, EvalResult
from async_rl.generator.rewards import RewardRunner
from async_rl.generator.rollout import SINGLE_TURN, Rollout, RolloutCounters, eval_sampling, finish_code
from async_rl.protocol import FINISH_REASONS, REWARD_OK, TOKEN_DTYPE, Prompt, Sample, TrajectoryGroup
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import Generation, ServedModel
from async_rl.serving.sampling import SamplingSpec


class SingleTurn(Rollout):
    def __init__(self, model: ServedModel, rewards: RewardRunner, engine_id: int, sampling: SamplingSpec) -> None:
        self.model = model
        self.rewards = rewards
        self.engine_id = engine_id
        self.sampling = sampling  # the engine's sampler: evaluations change only n, temperature, length

    async def _generate_scored(self, prompt: Prompt, sampling: SamplingSpec, request_id: str):
        """One request: (its generation, (reward, status) per completion)."""
        out = await self.model.generate(
            list(prompt.token_ids), vc.params_for(sampling), request_id, prompt.text, list(prompt.images)
        )
        if prompt.token_ids and out.prompt_ids != list(prompt.token_ids):
            # with images: vLLM expanded a placeholder to another token count than the prompt source's
            # processor did (other pixel bounds: vision.*), so the learner could not see the same pixels
            raise RuntimeError(f"prompt {prompt.prompt_id}: vLLM generated from other tokens than the rendered ones")
        scored = await asyncio.gather(
            *(
                self.rewards.score(
                    Sample(prompt=prompt, completion=c.text, completion_ids=c.token_ids, finish_reason=c.finish_reason)
                )
                for c in out.completions
            )
        )
        return out, scored

    async def group(self, prompt: Prompt, request_id: str, sampling: SamplingSpec, n: int) -> TrajectoryGroup:
        out, scored = await self._generate_scored(prompt, msgspec.structs.replace(sampling, n=n), request_id)
        return single_turn_group(prompt, self.engine_id, out, scored)

    async def evaluate(self, prompt: Prompt, params: EvalParams, request_id: str) -> EvalResult:
        out, scored = await self._generate_scored(prompt, eval_sampling(self.sampling, params, params.n), request_id)
        return EvalResult(
            prompt_id=prompt.prompt_id,
            data_source=prompt.data_source,
            rewards=[r for r, _ in scored],
            completion_lens=[len(c.token_ids) for c in out.completions],
            finish_reasons=[FINISH_REASONS.get(c.finish_reason, 0) for c in out.completions],
            reward_failures=sum(1 for _, st in scored if st != REWARD_OK),
        )

    def counters(self) -> RolloutCounters:
        return RolloutCounters(kind=SINGLE_TURN)


def single_turn_group(prompt: Prompt, engine_id: int, out: Generation, scored: list[tuple[float, int]]) -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt_id=prompt.prompt_id,
        engine_id=engine_id,
        prompt_tokens=np.asarray(out.prompt_ids, dtype=TOKEN_DTYPE),
        completions=[np.asarray(c.token_ids, dtype=TOKEN_DTYPE) for c in out.completions],
        logprobs=[np.asarray(c.logprobs, dtype=np.float32) for c in out.completions],
        rewards=[r for r, _ in scored],
        version_first=[out.version_first] * len(out.completions),
        version_last=[out.version_last] * len(out.completions),
        reward_status=[st for _, st in scored],
        finish_reasons=[finish_code(c.finish_reason, prompt.prompt_id) for c in out.completions],
        routes=[c.routes for c in out.completions] if all(c.routes is not None for c in out.completions) else None,
        images=list(prompt.images) or None,
    )
