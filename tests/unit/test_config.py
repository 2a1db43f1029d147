"""Config loading, overrides, one-line errors that name the key, and the config reference."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from async_rl.config import Config, apply_override, describe, load_config, to_yaml
from async_rl.errors import ConfigError, RunError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def config_error(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    msg = str(info.value)
    assert "\n" not in msg, f"config errors are one line, got {msg!r}"
    assert msg
    return msg


# ---------------------------------------------------------------- loading


def test_good_file_loads_typed_values(tmp_path):
    p = write(
        tmp_path,
        """
model:
  path: /models/x
  dtype: bfloat16
generators:
  num_engines: 3
  temperature: 0.7
train:
  max_lag: 2
  sync_every: 3
  prompts_per_step: 6
learner:
  world_size: 2
  lr: 0.0005
algorithm:
  dynamic_sampling: true
logging:
  wandb:
    mode: disabled
""",
    )
    cfg = load_config(p)
    assert isinstance(cfg, Config)
    assert cfg.model.path == "/models/x"
    assert cfg.model.dtype == "bfloat16"
    assert cfg.generators.num_engines == 3 and type(cfg.generators.num_engines) is int
    assert cfg.generators.temperature == 0.7
    assert cfg.train.max_lag == 2
    assert cfg.train.sync_every == 3
    assert cfg.train.prompts_per_step == 6
    assert cfg.learner.world_size == 2
    assert cfg.learner.lr == 0.0005 and type(cfg.learner.lr) is float
    assert cfg.algorithm.dynamic_sampling is True
    assert cfg.logging.wandb.mode == "disabled"
    # untouched fields keep their defaults
    assert cfg.generators.group_size == 8
    assert cfg.logging.wandb.project == "async_rl"


def test_int_given_for_float_field_becomes_float(tmp_path):
    cfg = load_config(write(tmp_path, "learner:\n  lr: 1\n"))
    assert cfg.learner.lr == 1.0 and type(cfg.learner.lr) is float


def test_defaults_fill_missing_sections(tmp_path):
    cfg = load_config(write(tmp_path, "task:\n  name: modsum\n"))
    default = Config()
    assert cfg.task.name == "modsum"
    assert cfg.task.seed == default.task.seed
    assert cfg.learner == default.learner
    assert cfg.generators == default.generators
    assert cfg.train == default.train
    assert cfg.weight_sync == default.weight_sync
    assert cfg.logging == default.logging


def test_empty_file_and_no_file_give_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == Config()
    assert load_config(write(tmp_path, "# only a comment\n")) == Config()
    assert load_config(None) == Config()


def test_quickstart_config_loads():
    cfg = load_config(REPO / "configs" / "quickstart.yaml")
    assert cfg.model.path == "tiny-qwen2"
    assert cfg.task.name == "repeat"
    assert cfg.generators.num_engines == 1
    assert cfg.train.max_lag == 1
    assert cfg.learner.world_size == 1
    assert cfg.learner.lr == 0.002
    assert cfg.logging.wandb.mode == "offline"


def test_to_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["generators.num_engines=2", "learner.lr=0.25"])
    assert load_config(write(tmp_path, to_yaml(cfg))) == cfg


# ---------------------------------------------------------------- errors naming the key


def test_unknown_top_level_key(tmp_path):
    msg = config_error(write(tmp_path, "modle:\n  path: x\n"))
    assert "'modle'" in msg
    assert "unknown" in msg


def test_unknown_nested_key(tmp_path):
    msg = config_error(write(tmp_path, "learner:\n  foo: 1\n"))
    assert "'learner.foo'" in msg
    assert "unknown" in msg


def test_unknown_deeply_nested_key():
    msg = config_error(None, ["logging.wandb.bar=2"])
    assert "'logging.wandb.bar'" in msg


def test_wrong_type_names_key(tmp_path):
    msg = config_error(write(tmp_path, "learner:\n  lr: abc\n"))
    assert "learner.lr" in msg
    assert "float" in msg


def test_wrong_type_int_field_given_float():
    msg = config_error(None, ["train.total_steps=1.5"])
    assert "train.total_steps" in msg


def test_bad_literal_names_key():
    msg = config_error(None, ["generators.pause_mode=sometimes"])
    assert "generators.pause_mode" in msg


def test_section_given_a_scalar_names_key():
    msg = config_error(None, ["learner=3"])
    assert "'learner'" in msg


@pytest.mark.parametrize(
    "override, key",
    [
        ("generators.num_engines=0", "generators.num_engines"),
        ("learner.lr=0", "learner.lr"),
        ("algorithm.tis_cap=1.0", "algorithm.tis_cap"),
        ("generators.gpu_memory_utilization=1.5", "generators.gpu_memory_utilization"),
        ("buffer.ingest_port=70000", "buffer.ingest_port"),
        ("train.max_lag=-1", "train.max_lag"),
    ],
)
def test_constraint_violation_names_key(override, key):
    msg = config_error(None, [override])
    assert key in msg


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    msg = config_error(missing)
    assert str(missing) in msg
    assert "does not exist" in msg


def test_directory_is_not_a_config_file(tmp_path):
    msg = config_error(tmp_path)
    assert "does not exist" in msg


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_yaml(tmp_path, text):
    msg = config_error(write(tmp_path, text))
    assert "mapping" in msg


def test_invalid_yaml_is_one_line(tmp_path):
    msg = config_error(write(tmp_path, "learner: [1, 2\ntrain: {\n"))
    assert "not valid YAML" in msg


# ---------------------------------------------------------------- overrides


def test_override_without_equals():
    msg = config_error(None, ["learner.lr"])
    assert "learner.lr" in msg
    assert "section.key=value" in msg
    tree: dict = {}
    with pytest.raises(ConfigError):
        apply_override(tree, "learner")
    assert tree == {}


def test_override_with_empty_key():
    with pytest.raises(ConfigError, match="empty key"):
        apply_override({}, "learner..lr=1")
    with pytest.raises(ConfigError, match="empty key"):
        apply_override({}, "=1")


def test_override_into_non_section():
    tree = {"model": {"path": "tiny-qwen2"}}
    with pytest.raises(ConfigError) as info:
        apply_override(tree, "model.path.x=1")
    assert "'model.path' is not a section" in str(info.value)
    assert tree == {"model": {"path": "tiny-qwen2"}}
    # the same through load_config, where an earlier override set the scalar
    msg = config_error(None, ["model.path=foo", "model.path.x=1"])
    assert "'model.path' is not a section" in msg


def test_override_values_parsed_as_yaml():
    tree: dict = {}
    apply_override(tree, "generators.num_engines=3")
    apply_override(tree, "algorithm.dynamic_sampling=true")
    apply_override(tree, "learner.lr=0.5")
    apply_override(tree, "logging.run_name=abc")
    apply_override(tree, "logging.wandb.project=")
    apply_override(tree, "x.y=[1, 2]")
    apply_override(tree, "a.b=c=d")  # only the first '=' splits
    assert tree == {
        "generators": {"num_engines": 3},
        "algorithm": {"dynamic_sampling": True},
        "learner": {"lr": 0.5},
        "logging": {"run_name": "abc", "wandb": {"project": ""}},
        "x": {"y": [1, 2]},
        "a": {"b": "c=d"},
    }
    assert type(tree["generators"]["num_engines"]) is int


def test_override_bad_yaml_value():
    msg = config_error(None, ["learner.lr=[1"])
    assert "learner.lr=[1" in msg
    assert "not valid YAML" in msg


def test_overrides_apply_on_top_of_file_in_order(tmp_path):
    p = write(tmp_path, "generators:\n  num_engines: 2\n  group_size: 4\n")
    cfg = load_config(p, ["generators.num_engines=5", "generators.num_engines=6", "algorithm.dynamic_sampling=true"])
    assert cfg.generators.num_engines == 6
    assert cfg.generators.group_size == 4
    assert cfg.algorithm.dynamic_sampling is True


def test_scientific_notation_float(tmp_path):
    # BUG: async_rl/config/loading.py apply_override/load_config use yaml.safe_load (YAML 1.1), which reads
    # '1e-3' (no dot) as the *string* '1e-3'; msgspec.convert then rejects it for a float field, so
    # the very common `learner.lr=1e-3` (or `lr: 1e-6` in a YAML file) fails with
    # "config key 'learner.lr': Expected `float`, got `str`".
    cfg = load_config(None, ["learner.lr=1e-3"])
    assert cfg.learner.lr == pytest.approx(1e-3)
    cfg = load_config(write(tmp_path, "learner:\n  lr: 1e-6\n"))
    assert cfg.learner.lr == pytest.approx(1e-6)


def test_on_off_are_words_and_booleans_are_true_and_false(tmp_path):
    # YAML 1.1 reads on/off/yes/no as booleans: `recover: off` failed with "Expected `str`, got `bool`".
    cfg = load_config(None, ["train.recover=off", "generators.enforce_eager=on"])
    assert (cfg.train.recover, cfg.generators.enforce_eager) == ("off", "on")
    cfg = load_config(write(tmp_path, "train:\n  recover: off\n  checkpoint_at_end: false\n"))
    assert (cfg.train.recover, cfg.train.checkpoint_at_end) == ("off", False)
    assert load_config(None, ["train.checkpoint_at_end=False"]).train.checkpoint_at_end is False
    assert "train.checkpoint_at_end" in config_error(None, ["train.checkpoint_at_end=no"])


# ---------------------------------------------------------------- cross-field rules


def test_max_lag_below_sync_every_minus_one():
    msg = config_error(None, ["train.max_lag=0", "train.sync_every=2"])
    assert "train.max_lag" in msg and "train.sync_every" in msg
    # the boundary max_lag == sync_every - 1 is fine
    cfg = load_config(None, ["train.max_lag=1", "train.sync_every=2"])
    assert cfg.train.sync_every == 2
    cfg = load_config(None, ["train.max_lag=0", "train.sync_every=1"])
    assert cfg.train.max_lag == 0


def test_prompts_per_step_not_divisible_by_world_size():
    msg = config_error(None, ["train.prompts_per_step=8", "learner.world_size=3"])
    assert "train.prompts_per_step" in msg and "learner.world_size" in msg
    cfg = load_config(None, ["train.prompts_per_step=9", "learner.world_size=3"])
    assert cfg.learner.world_size == 3


def test_sequence_parallel_size_is_checked_in_one_line():
    msg = config_error(None, ["learner.world_size=3", "learner.sequence_parallel_size=2"])
    assert "learner.sequence_parallel_size=2" in msg and "learner.world_size=3" in msg
    msg = config_error(None, ["learner.backend=megatron", "learner.world_size=2", "learner.sequence_parallel_size=2"])
    assert "learner.backend=torch" in msg and "Transformer Engine" in msg
    # the batch is cut into world / SP shards: 6 prompts over 4 ranks at SP = 2 is 3 each
    cfg = load_config(None, ["train.prompts_per_step=6", "learner.world_size=4", "learner.sequence_parallel_size=2"])
    assert cfg.learner.sequence_parallel_size == 2
    msg = config_error(None, ["train.prompts_per_step=3", "learner.world_size=4", "learner.sequence_parallel_size=2"])
    assert "data-parallel size 2" in msg


def test_max_tokens_must_be_below_max_model_len():
    msg = config_error(None, ["generators.max_tokens=128", "generators.max_model_len=128"])
    assert "generators.max_tokens" in msg and "generators.max_model_len" in msg
    config_error(None, ["generators.max_tokens=200", "generators.max_model_len=128"])
    cfg = load_config(None, ["generators.max_tokens=127", "generators.max_model_len=128"])
    assert cfg.generators.max_tokens == 127


# ---------------------------------------------------------------- describe


def _leaf_keys(struct, prefix=""):
    keys = []
    for f in msgspec.structs.fields(type(struct)):
        value = getattr(struct, f.name)
        if isinstance(value, msgspec.Struct):
            keys.extend(_leaf_keys(value, f"{prefix}{f.name}."))
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def test_describe_covers_every_leaf_with_one_line_description():
    rows = describe()
    keys = [k for k, _, _ in rows]
    assert keys == _leaf_keys(Config())
    assert len(keys) == len(set(keys))
    for key, default, desc in rows:
        assert desc.strip(), f"config key '{key}' has no description"
        assert "\n" not in desc, f"config key '{key}' has a multi-line description"
        assert default != ""
    by_key = {k: (d, desc) for k, d, desc in rows}
    assert by_key["learner.lr"][0] == "0.002"
    assert by_key["generators.pause_mode"][0] == "'keep'"
    assert "logging.wandb.mode" in by_key
    assert "logging.wandb" not in by_key


def test_every_override_key_from_describe_is_accepted():
    # each documented key can be set back to its own default through an override
    overrides = []
    for key, default, _ in describe():
        value = default[1:-1] if default.startswith("'") else default
        if value:  # an empty string default cannot be written as key=value unambiguously
            overrides.append(f"{key}={value}")
    assert len(overrides) >= 40
    assert load_config(None, overrides) == Config()


# ---------------------------------------------------------------- errors


def test_exit_codes():
    assert ConfigError.exit_code == 2
    assert RunError.exit_code == 1
    assert ConfigError("x").exit_code == 2
    assert RunError("x").exit_code == 1
    assert issubclass(ConfigError, Exception) and issubclass(RunError, Exception)
    assert not issubclass(ConfigError, RunError) and not issubclass(RunError, ConfigError)


def test_colocated_needs_synchronous_training():
    msg = config_error(None, ["placement=colocated", "train.max_lag=1"])
    assert "placement=colocated" in msg and "train.max_lag" in msg
    assert load_config(None, ["placement=colocated", "train.max_lag=0"]).placement == "colocated"
    assert "placement" in config_error(None, ["placement=hybrid"])


def test_the_model_presets_config_names_are_the_ones_the_models_package_builds():
    """config.py names the presets so that validating a config imports no model code."""
    from async_rl.config import MODEL_PRESETS
    from async_rl.models.tiny import ALL_PRESETS

    assert MODEL_PRESETS == ALL_PRESETS


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_passes_the_launch_check(path):
    """What `python -m async_rl.launch CONFIG` checks before anything starts (model, task, reward, the MoE
    settings, the frame limit) holds for every config a user is pointed at (configs/gpu/ needs its data)."""
    from async_rl.launch import check_inputs

    check_inputs(load_config(path))
