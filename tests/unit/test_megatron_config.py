"""`learner.backend: megatron` and its `learner.megatron` section: defaults and cross-field rules."""

from __future__ import annotations

import pytest

from async_rl.config import load_config
from async_rl.control import settings
from async_rl.errors import ConfigError


def test_torch_stays_the_default_backend():
    cfg = load_config(None)
    assert cfg.learner.backend == "torch"
    assert cfg.learner.megatron.tensor_parallel_size == 1
    assert cfg.learner.megatron.distributed_optimizer is True


def test_megatron_runs_every_algorithm_and_writes_checkpoints():
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"):
        cfg = load_config(None, ["learner.backend=megatron", f"algorithm.name={name}"])
        assert cfg.train.checkpoint_at_end


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learner.world_size=6", "learner.megatron.tensor_parallel_size=4"], "not a multiple of"),
        (["learner.world_size=6", "learner.megatron.tensor_parallel_size=2", "train.prompts_per_step=8"],
         "not divisible by the megatron data-parallel size 3"),
        (["learner.megatron.transformer_engine=maybe"], "learner.megatron.transformer_engine"),
        (["learner.megatron.attention=flash"], "learner.megatron.attention"),
        (["learner.megatron.attention=varlen", "learner.device=cuda", "model.dtype=float32"],
         "attention=varlen on CUDA needs model.dtype bfloat16"),
        (["learner.world_size=4", "learner.megatron.pipeline_parallel_size=2", "learner.megatron.expert_model_parallel_size=4",
          "train.prompts_per_step=8"], "expert_model_parallel_size=4 does not divide the 2 ranks of a pipeline stage"),
        (["learner.routing_replay=always"], "learner.routing_replay"),
    ],
)
def test_megatron_layout_errors_name_the_fields(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["learner.backend=megatron", *overrides])


def test_expert_parallelism_draws_from_the_ranks_of_a_stage():
    cfg = load_config(None, ["learner.backend=megatron", "learner.world_size=4", "learner.megatron.tensor_parallel_size=2",
                             "learner.megatron.expert_model_parallel_size=4", "train.prompts_per_step=8"])
    assert cfg.learner.megatron.expert_model_parallel_size == 4 and cfg.learner.routing_replay == "auto"


def test_world_size_that_only_megatron_model_parallelism_explains_is_accepted():
    # 4 ranks = TP 4, DP 1: the torch rule (prompts divisible by world size) does not apply
    cfg = load_config(
        None,
        ["learner.backend=megatron", "learner.world_size=4", "learner.megatron.tensor_parallel_size=4",
         "train.prompts_per_step=3"],
    )
    assert cfg.learner.world_size == 4


CPU = ["learner.backend=megatron", "learner.device=cpu"]


def test_megatron_on_cpu_requests_no_gpu_and_syncs_without_cuda_ipc():
    cfg = load_config(None, [*CPU, "learner.world_size=2", "learner.megatron.pipeline_parallel_size=2"])
    assert not settings.learner_on_cuda(cfg)
    assert settings.learner_on_cuda(load_config(None, ["learner.backend=megatron", "learner.device=cuda"]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.dtype=bfloat16"], "trains in float32"),
        (["learner.megatron.transformer_engine='on'"], "transformer_engine=on needs CUDA"),
        (["learner.world_size=2", "train.prompts_per_step=2"], "data-parallel size 2: .*distributed_optimizer=false"),
    ],
)
def test_megatron_on_cpu_refuses_what_megatron_cpu_does_not_cover(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*CPU, *overrides])


def test_megatron_rendezvous_is_on_the_node_ip(monkeypatch):
    """Other ranks may run on other nodes: the master address is this node's IP, not loopback."""
    from pathlib import Path

    from async_rl.learner import driver
    from async_rl.learner.driver import LearnerDriver

    cfg = load_config(None, CPU)
    # cluster.net.node_ip: Ray's node address inside an actor, the default route's source elsewhere
    monkeypatch.setattr(driver, "node_ip", lambda: "127.0.0.2")  # bindable, not 127.0.0.1
    rank = LearnerDriver(settings.learner_spec(cfg, "r", Path("/m"), Path("/m"), "tcp://127.0.0.1:2", None), 0, 2, "", [])
    host, port = rank.rendezvous_address().rsplit(":", 1)
    assert host == "127.0.0.2" and int(port) > 0
