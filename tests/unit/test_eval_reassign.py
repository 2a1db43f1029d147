"""An engine that dies during an evaluation: its prompts go to the engines left (or to its
replacement), each eval prompt is scored exactly once, and the record counts what moved. Ray's
wait/get are stood in for by ready-made answers: the phase's bookkeeping is what is tested here."""

from __future__ import annotations

import pytest
import ray

from async_rl.config import EvalConfig
from async_rl.errors import RunError
from async_rl.evaluation import phase
from async_rl.evaluation.phase import Evaluation
from async_rl.evaluation.scores import EvalBatch, EvalResult
from async_rl.protocol import Prompt


class Ref:
    """A finished call: its answer, or the error Ray would raise for it."""

    def __init__(self, answer: EvalBatch | BaseException) -> None:
        self.answer = answer


class Engine:
    """`behaviour(prompts)` -> what one evaluate call ends with; every call's prompt ids are kept."""

    def __init__(self, engine_id: int, behaviour) -> None:
        self.engine_id, self.behaviour, self.calls = engine_id, behaviour, []
        self.evaluate = self

    def remote(self, prompts: list[Prompt], params) -> Ref:
        self.calls.append([p.prompt_id for p in prompts])
        return Ref(self.behaviour(self, prompts))


def scored(engine: Engine, prompts: list[Prompt], died: bool = False) -> EvalBatch:
    results = [EvalResult(p.prompt_id, "src", [1.0], [4], [0]) for p in prompts]
    return EvalBatch(engine.engine_id, 3, 3, results, engine_died=died)


def ok(engine, prompts):
    return scored(engine, prompts)


def actor_dies(engine, prompts):
    return ray.exceptions.ActorDiedError()


def core_dies_after_first(engine, prompts):
    return scored(engine, prompts[:1], died=True)


@pytest.fixture(autouse=True)
def fake_ray(monkeypatch):
    def wait(refs, num_returns, timeout):
        return refs[:num_returns], refs[num_returns:]

    def get(ref):
        if isinstance(ref.answer, BaseException):
            raise ref.answer
        return ref.answer

    monkeypatch.setattr(phase.ray, "wait", wait)
    monkeypatch.setattr(phase.ray, "get", get)


def evaluation(prompts: int) -> Evaluation:
    return Evaluation(EvalConfig(enabled=True), [Prompt(prompt_id=i, text=f"q{i}") for i in range(prompts)], 8, 10)


def test_a_dead_cores_unscored_prompts_go_to_the_engine_left_and_it_is_replaced_after():
    a, b = Engine(0, core_dies_after_first), Engine(1, ok)
    replaced: list[list[int]] = []
    record = evaluation(6).run({0: a, 1: b}, 3, 1.0, lambda dead: replaced.append(list(dead)) or {})
    assert a.calls == [[0, 2, 4]] and b.calls == [[1, 3, 5], [2, 4]]  # 0 was scored before the core died
    assert (record.prompts, record.failed_prompts, record.reassigned_prompts, record.dead_engines) == (6, 0, 2, 1)
    assert replaced == [[0]]  # once the evaluation is done


def test_with_every_engine_dead_the_prompts_wait_for_replacements():
    a, b, c = Engine(0, actor_dies), Engine(1, actor_dies), Engine(2, ok)
    replaced: list[list[int]] = []

    def replace(dead):
        replaced.append(list(dead))
        return {2: c}

    record = evaluation(4).run({0: a, 1: b}, 3, 1.0, replace)
    # a's share went to b; b died with both shares; its replacement scored all four, each once.
    assert a.calls == [[0, 2]] and b.calls == [[1, 3], [0, 2]] and sorted(map(sorted, c.calls)) == [[0, 2], [1, 3]]
    assert replaced == [[0, 1]]
    assert (record.prompts, record.samples, record.failed_prompts, record.dead_engines) == (4, 4, 0, 2)
    assert record.reassigned_prompts == 6  # a's two prompts moved twice, b's two once


def test_a_prompt_scored_twice_is_refused():
    def twice(engine, prompts):
        return scored(engine, prompts + prompts[:1])

    with pytest.raises(RunError, match="1 repeated"):
        evaluation(2).run({0: Engine(0, twice)}, 3, 1.0, lambda dead: {})
