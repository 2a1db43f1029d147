"""What the generators sample with, beyond temperature: stop tokens from the model's generation
config, stop strings, and the nucleus/top-k/min-p filters. Built once per engine into a
`SamplingSpec`; vllm_compat turns it into vLLM's SamplingParams.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    n: int
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    stop: list[str] = []  # stop strings (the text given to rewards ends with the one that matched)
    stop_token_ids: list[int] = []  # EOS and stop tokens of the model's generation config
    ignore_eos: bool = False  # benchmarks: always max_tokens long
    seed: int | None = None  # the request's own sampling seed (vLLM gives its n samples seed, seed+1, ...)


def stop_token_ids(model_dir: str | Path) -> list[int]:
    """Every end-of-sequence id the model declares: generation_config.json's `eos_token_id` (an int
    or a list; chat models often list the end-of-turn token there) and config.json's. vLLM adds
    the same ids on its own (input_processor: update_from_generation_config); passing them
    explicitly keeps that behaviour visible, tested, and independent of vLLM's defaults."""
    from transformers import AutoConfig, GenerationConfig

    ids: list[int] = []

    def add(value) -> None:
        for v in [value] if isinstance(value, int) else list(value or []):
            if int(v) not in ids:
                ids.append(int(v))

    try:
        add(GenerationConfig.from_pretrained(str(model_dir)).eos_token_id)
    except OSError:  # no generation_config.json: the model config alone
        pass
    add(getattr(AutoConfig.from_pretrained(str(model_dir)), "eos_token_id", None))
    return ids


def request_seed(seed: int, prompt_id: int, salt: int = 0) -> int:
    """train.deterministic: a request's sampling seed from the run's generators.seed and its prompt, so
    the prompt samples the same tokens on any engine, beside any other requests. `salt` tells apart other requests of one prompt (an evaluation's version). Mixed by SeedSequence
    over 63 bits, so neighbouring prompts' seeds and their samples' seed + i never meet."""
    return int(np.random.SeedSequence([seed, prompt_id, salt]).generate_state(1, dtype=np.uint64)[0] >> 1)


def episode_sampling(sampling: SamplingSpec, episode: int) -> SamplingSpec:
    """A multi-turn group's `episode`-th episode: its own seed (each episode's turns are requests of
    one sample, and would otherwise all draw the same numbers). Unseeded samplers stay unseeded."""
    if sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=request_seed(sampling.seed, episode))


def turn_sampling(sampling: SamplingSpec, turn: int) -> SamplingSpec:
    """An episode's `turn`-th model call (from 1; an environment's turn, or an agent's call through the
    endpoint): its own seed from the episode's."""
    if sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=request_seed(sampling.seed, turn, salt=1))
