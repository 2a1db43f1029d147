"""The CPU placement plan and the vLLM OpenMP binding string. Pure logic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from async_rl.cluster.placement import CORES_ENV, PlacementPlan, ProcessPlacement, parse_cores, plan_placement
from async_rl.config import load_config
from async_rl.errors import ConfigError
from async_rl.serving.cpu_threads import omp_bind

REPO = Path(__file__).resolve().parents[2]


def cfg(*overrides: str):
    return load_config(None, list(overrides))


def test_one_engine_one_rank_on_two_cores():
    plan = plan_placement(cfg(), cores=[0, 1])
    assert plan == PlacementPlan(
        num_cores=2,
        engines=[ProcessPlacement("engine 0", [0])],
        learner_ranks=[ProcessPlacement("learner rank 0", [1])],
        oversubscribed=False,
    )


def test_quickstart_placement():
    plan = plan_placement(load_config(REPO / "configs" / "quickstart.yaml"), cores=[0, 1])
    assert [p.cores for p in plan.engines] == [[0]]
    assert [p.cores for p in plan.learner_ranks] == [[1]]
    assert not plan.oversubscribed


def test_two_engines_two_ranks_on_two_cores_wraps():
    plan = plan_placement(cfg("generators.num_engines=2", "learner.world_size=2"), cores=[0, 1])
    assert [p.cores for p in plan.engines] == [[0], [1]]
    assert [p.cores for p in plan.learner_ranks] == [[0], [1]]
    assert plan.oversubscribed is True
    assert plan.num_cores == 2


def test_multi_core_processes_take_consecutive_cores():
    plan = plan_placement(
        cfg("generators.num_engines=2", "generators.cpus_per_engine=2", "learner.cpus_per_rank=3"),
        cores=[4, 5, 6, 7, 8, 9, 10],
    )
    assert [p.cores for p in plan.engines] == [[4, 5], [6, 7]]
    assert [p.cores for p in plan.learner_ranks] == [[8, 9, 10]]
    assert not plan.oversubscribed  # exactly 7 cores for 7 asked


def test_one_core_short_is_oversubscribed():
    plan = plan_placement(cfg("generators.cpus_per_engine=2", "learner.cpus_per_rank=2"), cores=[0, 1, 2])
    assert [p.cores for p in plan.engines] == [[0, 1]]
    assert [p.cores for p in plan.learner_ranks] == [[2, 0]]
    assert plan.oversubscribed


def test_default_cores_come_from_affinity(monkeypatch):
    import os

    monkeypatch.delenv(CORES_ENV, raising=False)  # the parallel suite's workers set their own order
    plan = plan_placement(cfg())
    assert plan.num_cores == len(os.sched_getaffinity(0))
    assert plan.engines[0].cores == [min(os.sched_getaffinity(0))]


def test_cores_env_orders_the_cores_the_plan_hands_out(monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    order = allowed[1:] + allowed[:1]  # the first core last
    monkeypatch.setenv(CORES_ENV, ",".join(map(str, order)))
    plan = plan_placement(cfg())
    assert plan.engines[0].cores == [order[0]] and plan.learner_ranks[0].cores == [order[1 % len(order)]]
    assert parse_cores("4-6,0-1", list(range(8))) == [4, 5, 6, 0, 1]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("0,x", "ASYNC_RL_CORES='0,x': 'x' is not a core or a range of cores"),
        ("0,9", r"ASYNC_RL_CORES='0,9' cores \[9\] are not among this process's \[0, 1\]"),
        ("1,1", "ASYNC_RL_CORES='1,1' names a core twice or none"),
    ],
)
def test_a_bad_cores_env_is_one_line_naming_it(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_cores(spec, [0, 1])


def test_render_mentions_every_role():
    plan = plan_placement(cfg("generators.num_engines=2", "learner.world_size=2"), cores=[0, 1])
    text = plan.render()
    for role in ("engine 0", "engine 1", "learner rank 0", "learner rank 1", "buffer", "controller"):
        assert role in text, role
    assert "OVERSUBSCRIBED" in text
    assert "2 cores" in text
    lines = text.splitlines()
    assert any("engine 1" in line and line.rstrip().endswith("cores 1") for line in lines)
    ok = plan_placement(cfg(), cores=[0, 1]).render()
    assert "OVERSUBSCRIBED" not in ok
    assert "learner rank 0" in ok and "engine 0" in ok


# ---------------------------------------------------------------- vLLM OpenMP binding


def test_omp_bind_splits_cores_among_tp_workers():
    assert omp_bind([0, 1, 2, 3], 2) == "0,1|2,3"
    assert omp_bind([0, 1, 2, 3], 1) == "0,1,2,3"
    assert omp_bind([4, 5, 6, 7, 8, 9], 3) == "4,5|6,7|8,9"
    assert omp_bind([0], 1) == "0"
    assert omp_bind([7], 1) == "7"


def test_omp_bind_fewer_cores_than_workers_reuses_cores():
    assert omp_bind([0], 2) == "0|0"
    assert omp_bind([3, 5], 4) == "3|5|3|5"


def test_importing_vllm_compat_does_not_import_vllm():
    code = (
        "import sys\n"
        "import async_rl.serving.vllm_compat as c\n"
        "assert c.EXTENSION_CLS == 'async_rl.serving.worker_extension.WeightReceiverExtension', c.EXTENSION_CLS\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'ray', 'cupy', 'megatron'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "[]"


def test_colocated_learner_takes_the_engines_cores():
    plan = plan_placement(
        cfg("placement=colocated", "train.max_lag=0", "generators.cpus_per_engine=2", "learner.cpus_per_rank=2"),
        cores=[0, 1],
    )
    assert plan.colocated and not plan.oversubscribed
    assert plan.engines[0].cores == [0, 1] and plan.learner_ranks[0].cores == [0, 1]
    assert "alternate on the same cores" in plan.render()
