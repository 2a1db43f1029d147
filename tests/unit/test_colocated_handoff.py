"""Colocated placement's GPU memory hand-off, on CPU with recording stubs in place of Ray actors: the
engines start before the learner sets up (vLLM sizes its KV cache from what it sees allocated while
it starts), and every learner rank gives back its gradients and cached blocks before a weight sync
wakes the engines. The release itself is checked on a real torch model (its CUDA part is GPU-only:
tests/gpu)."""

from __future__ import annotations

import types

import pytest
import torch

from async_rl.config import Config, SecurityConfig
from async_rl.control import runtime as runtime_mod
from async_rl.control.start_retry import StartRetry
from async_rl.learner import gpu_memory


class Recorder:
    def __init__(self) -> None:
        self.log: list[str] = []


class StubActor:
    """`actor.method.remote(*args)` records the call and returns the method's result directly."""

    def __init__(self, rec: Recorder, name: str, results: dict | None = None) -> None:
        self._rec, self._name, self._results = rec, name, results or {}

    def __getattr__(self, method: str):
        def remote(*args):
            self._rec.log.append(f"{self._name}.{method}{args if args else ''}")
            return self._results.get(method, True)

        return types.SimpleNamespace(remote=remote)


class StubGroup:
    def __init__(self, actors: list[StubActor]) -> None:
        self.actors = actors

    def call(self, fn, timeout_s=None):
        return [fn(a) for a in self.actors]


class StubPool:
    def __init__(self, rec: Recorder) -> None:
        self._rec = rec

    def add(self, count: int, paused: bool, while_starting=None) -> list[int]:
        self._rec.log.append("engines starting")
        if while_starting is not None:
            while_starting()
        self._rec.log.append("engines started")
        return list(range(count))

    def rebuild_membership(self, sender) -> None:
        self._rec.log.append("membership")

    def sync(self, sender, version: int) -> float:
        self._rec.log.append(f"engines sync v{version} (pause wakes them)")
        return 0.0


def runtime_with(monkeypatch, placement: str) -> tuple[runtime_mod.Runtime, Recorder]:
    rec = Recorder()
    cfg = Config(placement=placement, security=SecurityConfig(curve=False))
    rt = runtime_mod.Runtime.__new__(runtime_mod.Runtime)
    rt.cfg, rt.plan, rt.keys, rt.run_id, rt.model_dir = cfg, None, None, "r", None
    rt._pools, rt._generators_version, rt._acked_step, rt._learner = [], 0, -1, None
    ranks = [StubActor(rec, f"rank{r}") for r in range(2)]
    monkeypatch.setattr(runtime_mod.ray, "get", lambda x, timeout=None: x)
    monkeypatch.setattr(runtime_mod, "warn_insecure", lambda: None)
    monkeypatch.setattr(runtime_mod, "GeneratorPool", lambda *a, **k: StubPool(rec))
    monkeypatch.setattr(rt, "_make_buffer", lambda restore: (StubActor(rec, "buffer"), None), raising=False)
    monkeypatch.setattr(rt, "_make_learner", lambda: StubGroup(ranks), raising=False)
    return rt, rec


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_colocated_engines_start_before_the_learner_sets_up(monkeypatch, placement):
    rt, rec = runtime_with(monkeypatch, placement)
    rt.start(None, engines_paused=False, starts=StartRetry(1, 0.0, (RuntimeError,)))
    order = [e for e in rec.log if e.startswith("engines start") or e.endswith(".setup")]
    if placement == "colocated":
        assert order == ["engines starting", "engines started", "rank0.setup", "rank1.setup"]
    else:  # disaggregated: the learner is made and set up while vLLM starts
        assert order == ["engines starting", "rank0.setup", "rank1.setup", "engines started"]


@pytest.mark.parametrize("during_step", [False, True])
def test_colocated_sync_releases_learner_memory_on_every_rank_before_waking_engines(monkeypatch, during_step):
    rt, rec = runtime_with(monkeypatch, "colocated")
    rt._learner = StubGroup([StubActor(rec, f"rank{r}") for r in range(2)])
    rt._generators = StubPool(rec)
    assert rt.sync_weights(3, during_step=during_step)
    wake = rec.log.index("engines sync v3 (pause wakes them)")
    released = [i for i, e in enumerate(rec.log) if ".release_gpu_memory" in e]
    assert len(released) == 2 and max(released) < wake
    assert max(i for i, e in enumerate(rec.log) if ".gather_weights" in e) < min(released)
    # gradients are dropped only between steps, never under a step that is running
    assert all(e.endswith(f"({not during_step},)") for e in rec.log if ".release_gpu_memory" in e)


def test_disaggregated_sync_does_not_release(monkeypatch):
    rt, rec = runtime_with(monkeypatch, "disaggregated")
    rt._learner = StubGroup([StubActor(rec, "rank0")])
    rt._generators = StubPool(rec)
    rt.sync_weights(1)
    assert not any("release_gpu_memory" in e for e in rec.log)


def test_release_drops_gradients_between_steps_only():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    owner = types.SimpleNamespace(model=model, optimizer=opt, lr=1.0)
    assert gpu_memory.optimizers_of(owner) == [opt]
    assert gpu_memory.release([opt], drop_grads=False) == 0  # no CUDA here: nothing cached to free
    assert all(p.grad is not None for p in model.parameters())
    gpu_memory.release(gpu_memory.optimizers_of(owner), drop_grads=True)
    assert all(p.grad is None for p in model.parameters())


class PoolWhoseEngineDiesInTheJoin(StubPool):
    """Engine 0's core dies while the first weight group forms (seen in CI: EngineDied in
    join_weight_group); it is found dead, dropped and started again, and the group formed anew."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__(rec)
        self.engines: dict[int, str] = {}
        self.joins = 0
        self._next_id = 0  # engine ids are never reused

    def add(self, count: int, paused: bool, while_starting=None) -> list[int]:
        new = list(range(self._next_id, self._next_id + count))
        self._next_id += count
        self.engines.update({i: "engine" for i in new})
        super().add(count, paused, while_starting)
        return new

    def rebuild_membership(self, sender) -> None:
        self.joins += 1
        if self.joins == 1:
            raise RuntimeError("join_weight_group: vLLM's engine core died (killed by SIGKILL)")
        self._rec.log.append(f"membership of {sorted(self.engines)}")

    def find_dead(self) -> list[int]:
        return [0]

    def drop_dead(self, engine_id: int) -> int:
        del self.engines[engine_id]
        self._rec.log.append(f"dropped {engine_id}")
        return 0


def test_an_engine_that_dies_while_the_first_group_forms_is_replaced(monkeypatch):
    rt, rec = runtime_with(monkeypatch, "disaggregated")
    pool = PoolWhoseEngineDiesInTheJoin(rec)
    monkeypatch.setattr(runtime_mod, "GeneratorPool", lambda *a, **k: pool)
    rt.cfg.generators.num_engines = 2
    said: list[str] = []
    monkeypatch.setattr("builtins.print", lambda line, **k: said.append(line))
    starts = StartRetry(2, 0.0, (RuntimeError,))
    rt.start(None, engines_paused=False, starts=starts)
    assert rec.log[-4:] == ["dropped 0", "engines starting", "engines started", "membership of [1, 2]"]
    assert pool.joins == 2 and starts.failed == 1
    assert any("joining the weight group: start 1 of 2 failed (" in s and "SIGKILL" in s for s in said)
