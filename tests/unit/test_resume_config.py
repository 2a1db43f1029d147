"""`launch --resume RUN_DIR`: the run's own saved config unless a CONFIG is given; a CONFIG that differs
is named key by key, another model is refused; `key=value` right after RUN_DIR is an override."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_rl.config import load_config, to_yaml
from async_rl.control.resume_config import check_given, saved_config, saved_with_overrides, split_positionals
from async_rl.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def saved_run(tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(load_config(QUICKSTART, list(overrides))))
    return run_dir


def test_without_config_the_saved_one_is_used_with_overrides_named(tmp_path):
    run_dir = saved_run(tmp_path, "train.total_steps=40")
    cfg, line = saved_with_overrides(run_dir, [])
    assert cfg.train.total_steps == 40  # not the quickstart's 100
    assert line == f"resume: the run's saved config {run_dir / 'config.yaml'}"
    cfg, line = saved_with_overrides(run_dir, ["train.total_steps=60", "learner.lr=1e-4"])
    assert (cfg.train.total_steps, cfg.learner.lr) == (60, 1e-4)
    assert line.endswith("with override(s) on top: train.total_steps=60 learner.lr=1e-4") and "\n" not in line


def test_the_newest_resume_config_wins(tmp_path):
    run_dir = saved_run(tmp_path, "train.total_steps=40")
    (run_dir / "config.resume-8.yaml").write_text(to_yaml(load_config(QUICKSTART, ["train.total_steps=50"])))
    (run_dir / "config.resume-16.yaml").write_text(to_yaml(load_config(QUICKSTART, ["train.total_steps=60"])))
    assert saved_config(run_dir).name == "config.resume-16.yaml"
    assert saved_with_overrides(run_dir, [])[0].train.total_steps == 60


def test_a_run_dir_without_saved_config_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="has no saved config.yaml"):
        saved_config(tmp_path)


def test_a_differing_config_is_named_key_by_key_in_one_line(tmp_path):
    run_dir = saved_run(tmp_path, "train.total_steps=40")
    given = load_config(QUICKSTART, ["logging.run_name=other"])  # logging does not change the run
    saved = load_config(run_dir / "config.yaml")
    line = check_given(run_dir / "config.yaml", saved, given)
    assert line == "resume: CONFIG differs from the run's saved config (config.yaml) in 1 key(s): train.total_steps 40 -> 100"
    assert check_given(run_dir / "config.yaml", saved, load_config(QUICKSTART, ["train.total_steps=40"])) is None


def test_another_model_is_refused(tmp_path):
    run_dir = saved_run(tmp_path)
    with pytest.raises(ConfigError, match=r"^--resume: model.path is 'tiny-qwen2-wide' but the run was trained from"):
        check_given(run_dir / "config.yaml", load_config(run_dir / "config.yaml"), load_config(QUICKSTART, ["model.path=tiny-qwen2-wide"]))


def test_an_override_in_the_config_slot_is_an_override(tmp_path):
    assert split_positionals("train.total_steps=60", ["train.lr=1"]) == (None, ["train.total_steps=60", "train.lr=1"])
    assert split_positionals(str(QUICKSTART), ["a.b=1"]) == (str(QUICKSTART), ["a.b=1"])
    assert split_positionals(None, []) == (None, [])
