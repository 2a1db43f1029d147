"""Request seeds (train.deterministic): every request samples with a seed of its own, made from the
run's generators.seed and its prompt, so a prompt samples the same tokens on any engine, beside any
other requests, in any run with that seed (vLLM seeds a request's i-th sample with seed + i)."""

from __future__ import annotations

import msgspec
import numpy as np

from async_rl.evaluation.scores import EvalParams
from async_rl.serving.sampling import SamplingSpec


def request_seed(seed: int, prompt_id: int, salt: int = 0) -> int:
    """`salt` tells apart other requests of one prompt (an evaluation's version). Mixed by SeedSequence
    over 63 bits, so neighbouring prompts' seeds and their samples' seed + i never meet."""
    return int(np.random.SeedSequence([seed, prompt_id, salt]).generate_state(1, dtype=np.uint64)[0] >> 1)


class RequestSeeds:
    def __init__(self, seed: int | None) -> None:
        """`seed`: generators.seed; None: no seeds of our own (vLLM's engine-wide generator samples)."""
        self._seed = seed

    def sampling(self, base: SamplingSpec, prompt_id: int) -> SamplingSpec:
        """The sampler of a training request for `prompt_id`."""
        if self._seed is None:
            return base
        return msgspec.structs.replace(base, seed=request_seed(self._seed, prompt_id))

    def eval(self, params: EvalParams, prompt_id: int, version: int) -> EvalParams:
        """The sampler of an eval request: its own seed from its prompt and the version evaluated."""
        if self._seed is None:
            return params
        return msgspec.structs.replace(params, seed=request_seed(self._seed, prompt_id, salt=version + 1))


def episode_sampling(sampling: SamplingSpec, episode: int) -> SamplingSpec:
    """A multi-turn group's `episode`-th episode: its own seed (each episode's turns are requests of
    one sample, and would otherwise all draw the same numbers). Unseeded samplers stay unseeded."""
    if sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=request_seed(sampling.seed, episode))


def turn_sampling(sampling: SamplingSpec, turn: int) -> SamplingSpec:
    """An episode's `turn`-th model call (from 1): its own seed from the episode's."""
    if sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=request_seed(sampling.seed, turn, salt=1))
