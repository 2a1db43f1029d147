"""The arithmetic brevity probe's bookkeeping (benchmarks/probe_brevity.py): which completions are cut,
how much of the reward they earn, and the group-relative advantage GRPO would give cut and stopped
samples (only groups whose samples differ in reward count)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import probe_brevity as pb  # noqa: E402


def row(reward: float, cut: bool, boxed: bool = False, restated: bool = False, tokens: int = 64) -> dict:
    return {"reward": reward, "cut": cut, "boxed": boxed, "restated": restated, "tokens": tokens}


def test_the_questions_expression_is_what_the_completion_may_restate():
    assert pb.expression("What is 48 - 71?") == "48 - 71"


def test_stats_split_the_reward_between_cut_and_stopped_completions():
    rows = [row(1.0, True, restated=True), row(1.0, True, boxed=True), row(0.0, True), row(1.0, False, tokens=10)]
    s = pb.stats(rows)
    assert s["cut_share"] == 0.75 and s["reward_cut"] == pytest.approx(2 / 3) and s["reward_stopped"] == 1.0
    assert s["reward_share_of_cut"] == pytest.approx(2 / 3)
    assert (s["cut_rewarded_boxed"], s["cut_rewarded_last_number"], s["cut_rewarded_restated"]) == (1, 1, 1)


def test_advantages_count_only_groups_with_a_reward_spread():
    # group 1: one cut sample right, two stopped wrong; group 2: all wrong (no signal, left out)
    rows = [row(1.0, True), row(0.0, False), row(0.0, False), row(0.0, True), row(0.0, False), row(0.0, False)]
    a = pb.advantages(rows, 3)
    assert (a["groups"], a["groups_with_signal"]) == (2, 1)
    assert a["mean_advantage_cut"] == pytest.approx(2 / 3) and a["mean_advantage_stopped"] == pytest.approx(-1 / 3)
    for r, shaped in zip(rows, [0.0, 0.0, 0.0, 0.0, 0.0, 1.0], strict=True):
        r["shaped"] = shaped
    b = pb.advantages(rows, 3, "shaped")  # another score: now only group 2 differs
    assert b["groups_with_signal"] == 1 and b["mean_advantage_cut"] == pytest.approx(-1 / 3)
