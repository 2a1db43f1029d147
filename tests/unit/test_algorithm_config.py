"""The `algorithm` config section: defaults, cross-field rules with one-line errors naming the keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_rl.config import load_config
from async_rl.control.settings import buffer_settings
from async_rl.errors import ConfigError


def error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_defaults_are_grpo_behaviour_objective_without_reference():
    a = load_config(None).algorithm
    assert (a.name, a.objective, a.kl_coef, a.dynamic_sampling) == ("grpo", "behaviour", 0.0, False)
    assert (a.clip_eps_low, a.clip_eps_high, a.tis_cap) == (0.2, 0.2, 2.0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"])
def test_every_algorithm_name_loads(name):
    assert load_config(None, [f"algorithm.name={name}"]).algorithm.name == name


def test_unknown_algorithm_names_the_key():
    assert "algorithm.name" in error(["algorithm.name=dpo"])


def test_kl_in_reward_needs_a_token_level_estimator_and_a_coefficient():
    assert "algorithm.kl_in_reward" in error(["algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1"])
    assert "algorithm.kl_coef" in error(["algorithm.name=ppo", "algorithm.kl_in_reward=true"])
    cfg = load_config(None, ["algorithm.name=ppo", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1"])
    assert cfg.algorithm.kl_in_reward


def test_k1_is_refused_as_a_loss_term_and_kept_in_the_reward():
    assert "algorithm.kl_estimator=k1" in error(["algorithm.kl_coef=0.1", "algorithm.kl_estimator=k1"])
    for estimator in ("k2", "k3"):
        assert load_config(None, ["algorithm.kl_coef=0.1", f"algorithm.kl_estimator={estimator}"])
    cfg = load_config(
        None, ["algorithm.name=ppo", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1", "algorithm.kl_estimator=k1"]
    )
    assert cfg.algorithm.kl_estimator == "k1"


def test_ratio_mask_bounds_must_straddle_one():
    assert "algorithm.ratio_mask_high" in error(["algorithm.ratio_mask_high=0.9"])
    assert "algorithm.ratio_mask_low" in error(["algorithm.ratio_mask_low=1.5"])
    cfg = load_config(None, ["algorithm.ratio_mask_low=0.1", "algorithm.ratio_mask_high=10"])
    assert (cfg.algorithm.ratio_mask_low, cfg.algorithm.ratio_mask_high) == (0.1, 10.0)


def test_dynamic_sampling_switches_the_buffer_filter():
    assert buffer_settings(load_config(None, ["algorithm.dynamic_sampling=true"]), "r", None, Path("m")).filter_uniform_groups
    assert not buffer_settings(load_config(None), "r", None, Path("m")).filter_uniform_groups
