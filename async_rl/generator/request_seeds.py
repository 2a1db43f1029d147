"""Request seeds (train.deterministic): every request samples with a seed of its own, made from the
run's generators.seed and its prompt, so a prompt samples the same tokens on any engine, beside any
other requests, in any run with that seed (vLLM seeds a request's i-th sample with seed + i).
Episodes and their calls derive theirs from it (serving/sampling.py)."""

from __future__ import annotations

import msgspec

from async_rl.evaluation.scores import EvalParams
from async_rl.serving.sampling import SamplingSpec, request_seed


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

