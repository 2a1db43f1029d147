"""`learner.backend: megatron` and its `learner.megatron` section: defaults and cross-field rules."""

from __future__ import annotations

import pytest

from async_rl import settings
from async_rl.config import load_config
from async_rl.errors import ConfigError

NO_CHECKPOINTS = ["train.checkpoint_every=0", "train.checkpoint_at_end=false"]  # not written by megatron yet


def test_torch_stays_the_default_backend():
    cfg = load_config(None)
    assert cfg.learner.backend == "torch"
    assert cfg.learner.megatron.tensor_parallel_size == 1
    assert cfg.learner.megatron.distributed_optimizer is True


def test_megatron_layout_is_passed_to_the_ranks():
    cfg = load_config(
        None,
        [
            "learner.backend=megatron",
            "learner.world_size=8",
            "learner.megatron.tensor_parallel_size=2",
            "learner.megatron.pipeline_parallel_size=2",
            "learner.megatron.micro_batches=4",
            "train.prompts_per_step=8",
            "generators.group_size=4",
            *NO_CHECKPOINTS,
        ],
    )
    m = settings.megatron_settings(cfg)
    assert (m.tensor_parallel_size, m.pipeline_parallel_size, m.micro_batches) == (2, 2, 4)
    assert m.probe_samples == cfg.train.mismatch_probe_samples


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learner.world_size=6", "learner.megatron.tensor_parallel_size=4"], "not a multiple of"),
        (["learner.world_size=6", "learner.megatron.tensor_parallel_size=2", "train.prompts_per_step=8"],
         "not divisible by the megatron data-parallel size 3"),
        (["learner.megatron.micro_batches=3", "train.prompts_per_step=4", "generators.group_size=4"],
         "micro_batches=3 does not divide a rank's 16 sequences"),
        (["learner.megatron.transformer_engine=maybe"], "learner.megatron.transformer_engine"),
    ],
)
def test_megatron_layout_errors_name_the_fields(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["learner.backend=megatron", *NO_CHECKPOINTS, *overrides])


def test_megatron_refuses_checkpoint_settings_it_cannot_honour():
    with pytest.raises(ConfigError, match="does not write checkpoints yet"):
        load_config(None, ["learner.backend=megatron"])


def test_world_size_that_only_megatron_model_parallelism_explains_is_accepted():
    # 4 ranks = TP 4, DP 1: the torch rule (prompts divisible by world size) does not apply
    cfg = load_config(
        None,
        ["learner.backend=megatron", "learner.world_size=4", "learner.megatron.tensor_parallel_size=4",
         "train.prompts_per_step=3", *NO_CHECKPOINTS],
    )
    assert cfg.learner.world_size == 4
