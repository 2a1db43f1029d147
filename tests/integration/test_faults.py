"""SIGKILL at a random moment, one of each kind of process, during one real run (tiny model), each on
a machine kept busy by CPU burners: a vLLM engine core (its Ray actor lives on), an engine's Ray actor,
the buffer. The moment is drawn from a seeded generator and printed, so a failure can be replayed.
And an engine that dies during an evaluation. (A learner rank's death stops the run with one line:
test_elastic.py.)"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import threading
import time

import pytest
import ray
from _load import start_burners, stop_burners
from test_elastic import SHORT, events
from test_training_run import check_common, run_short

from async_rl.evaluation.phase import Evaluation

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]  # one Ray for the module

SEED = int(os.environ.get("FAULTS_SEED", "13"))
# A death is noticed (and logged) within this. Measured on the busy 2-core machine (this test, five
# runs): the buffer's 0.1-1.4 s, an engine actor's 1.3-9.1 s, a vLLM engine core's 0.4-13.2 s (seen
# when vLLM's client in the engine's actor sees the process exit; the engine's `watch` reads vLLM's
# `errored`). The 13.2 s one landed just after a weight update, between steps, where no watch is pending.
DETECT_S = 20.0
MARGIN_S = 30.0  # a step may take the replacement's start-up plus this


def death_logged_since(run_dir, since: float) -> bool:
    """The run's scaling log holds a death logged at or after `since` (wall time)."""
    try:
        return any("died" in e["reason"] and e["at"] >= since for e in events(run_dir))
    except (FileNotFoundError, ValueError):  # no event yet, or the line being written
        return False


def burn_until_noticed(run_dir, since: float, procs: list) -> None:
    """Stop `procs` once a death at or after `since` is logged, or once the detection window (and
    2 s) passed."""
    deadline = time.monotonic() + DETECT_S + 2
    while time.monotonic() < deadline and not death_logged_since(run_dir, since):
        time.sleep(0.1)
    stop_burners(procs)


def test_sigkill_engine_core_engine_actor_and_buffer_at_random_moments(tmp_path, model_cache):
    rng = random.Random(SEED)
    plan = {1: "engine_core", 3: "engine_actor", 5: "buffer"}  # after step k, during step k + 1
    delays = {k: rng.uniform(0.0, 3.0) for k in plan}
    print(f"faults seed {SEED}: " + ", ".join(f"{plan[k]} {delays[k]:.2f}s after step {k + 1}" for k in plan))
    killed: dict[str, float] = {}  # kind -> wall time of the kill
    burners: list = []

    def kill(controller, kind: str) -> None:
        if kind == "buffer":
            pids = [ray.get(controller.buffer.pid.remote())]
        else:
            victim = controller.generators.pids()[sorted(controller.generators.engines)[0]]
            pids = victim.engine_core if kind == "engine_core" else [victim.actor]
        # Detection must not wait for the controller's loop to get a turn: every core is kept busy
        # from just before the kill until the supervisor logged a death after it (or the detection
        # window is over); the replacement then starts on free cores, as after a real burst of load.
        procs = start_burners()
        burners.extend(procs)
        killed[kind] = time.time()
        threading.Thread(target=burn_until_noticed, args=(controller.run_dir, killed[kind], procs), daemon=True).start()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    fired = {k: threading.Event() for k in plan}

    def kill_later(controller, k: int) -> None:
        kill(controller, plan[k])
        fired[k].set()

    def between(controller, step):
        # A kill scheduled earlier must land while the run goes on: on a quiet machine a step takes
        # ~0.2 s, so without this wait a kill drawn 3 s out would come after the last step.
        for k in plan:
            if k < step:
                assert fired[k].wait(30), f"the {plan[k]} kill never fired"
        if step in plan:  # a timer, so the kill lands wherever the run is then (step, sync, lease)
            threading.Timer(delays[step], kill_later, (controller, step)).start()

    try:
        out = run_short(
            tmp_path, model_cache, [*SHORT, "train.total_steps=8", "generators.num_engines=2"], between=between
        )
    finally:
        stop_burners(burners)
    cfg, summary, _, engine_cks, final, records = out
    assert set(killed) == set(plan.values()), killed
    log = events(tmp_path)
    died = {e["reason"].split(";")[0]: e for e in log if "died" in e["reason"]}
    # Detection: from the kill to the supervisor's event, for each kind.
    core_ev = next(e for r, e in died.items() if r.startswith("engine ") and e["at"] > killed["engine_core"])
    actor_ev = next(e for r, e in died.items() if r.startswith("engine ") and e["at"] > killed["engine_actor"])
    buffer_ev = died["buffer died"]
    detect = {
        "engine_core": core_ev["at"] - killed["engine_core"],
        "engine_actor": actor_ev["at"] - killed["engine_actor"],
        "buffer": buffer_ev["at"] - killed["buffer"],
    }
    print("detection s:", {k: round(v, 2) for k, v in detect.items()})
    assert all(0 <= v < DETECT_S for v in detect.values()), detect
    # No step held up longer than a replacement's start-up (measured here) plus a margin.
    started = [e["at"] for e in log if e["reason"].startswith("started engine")]
    startup = max(min(t for t in started if t >= d["at"]) - d["at"] for d in (core_ev, actor_ev))
    steps = [records[0]["elapsed_s"]] + [b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(records)]
    print(f"replacement start-up {startup:.1f}s; step times", [round(s, 1) for s in steps])
    assert max(steps[1:]) < startup + MARGIN_S
    # Every process is back: two engines hold the learner's weights, every step trained a full batch,
    # the accounting balances and nothing was lost (dead engines' and the dead buffer's leases requeued).
    # A step held up by a recovery lets groups leased before it go stale: dropped in whole groups.
    check_common(
        *out, engines=sorted(engine_cks), rejected_ok=("unknown_prompt", "wrong_engine"),
        requeued=final.accounts.requeued, late_groups=True,
    )
    assert len(engine_cks) == 2 and summary.steps == cfg.train.total_steps
    # (requeued may be 0: a kill can land when every group of the dead engine had already arrived)
    assert final.accounts.lost == 0
    # Nothing trained twice: exactly one batch per step was acknowledged.
    batch = cfg.train.prompts_per_step * cfg.generators.group_size
    assert final.accounts.trained == batch * cfg.train.total_steps


def test_evaluation_survives_an_engine_dying_mid_evaluation(tmp_path, model_cache, monkeypatch):
    """Two engines, an evaluation at the start and one at the end. In the first, engine 0's vLLM
    engine core is killed before its share reaches it; in the second, an engine's Ray actor is
    killed with its share in flight. Each time exactly its prompts go to the other engine, the record
    counts them, every eval prompt is scored once, and the dead engine is replaced: the run goes on."""
    real = Evaluation._dispatch
    sent: list[tuple[int, int, list[int]]] = []  # (evaluation: its last_step, engine id, prompt ids)
    killed: list[tuple[str, int, list[int]]] = []  # (what, engine id, the prompts it held)

    def dispatch(self, engine, prompts):
        engine_id = ray.get(engine.stats.remote(), timeout=60).engine_id
        ids = [p.prompt_id for p in prompts]
        first = not any(e == self.last_step for e, _, _ in sent)
        sent.append((self.last_step, engine_id, ids))
        pids = ray.get(engine.pids.remote(), timeout=60)
        if first and self.last_step == -1:  # the first evaluation: its engine core dies
            for pid in pids.engine_core:
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while ray.get(engine.healthy.remote(), timeout=60):  # the actor has seen it die
                assert time.monotonic() < deadline, "the engine never noticed its core died"
                time.sleep(0.1)
            killed.append(("engine_core", engine_id, ids))
        ref = real(self, engine, prompts)
        if first and self.last_step >= 0:  # the last evaluation: the actor dies with its share in flight
            os.kill(pids.actor, signal.SIGKILL)
            killed.append(("engine_actor", engine_id, ids))
        return ref

    monkeypatch.setattr(Evaluation, "_dispatch", dispatch)
    evals = ["eval.enabled=true", "eval.max_prompts=6", "eval.n=2", "eval.temperature=1.0", "eval.every=0"]
    out = run_short(tmp_path, model_cache, [*SHORT, "train.total_steps=2", "generators.num_engines=2", *evals])
    cfg, summary, _, engine_cks, final, records = out
    assert [(k, e) for k, e, _ in killed] == [("engine_core", 0), ("engine_actor", 1)], killed
    records_eval = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records_eval] == [0, 2]
    for (_, dead, held), evaluation, record in zip(killed, (-1, 0), records_eval, strict=True):
        # Exactly the dead engine's prompts were sent again, to the engine left, and counted.
        again = [(e, ids) for s, e, ids in sent if s == evaluation][2:]
        assert len(again) == 1 and again[0][0] != dead and again[0][1] == held, sent
        assert record["reassigned_prompts"] == len(held) == 3 and record["dead_engines"] == 1
        # Every eval prompt scored exactly once (the phase checks the ids), none counted failed.
        assert (record["prompts"], record["samples"], record["failed_prompts"]) == (6, 12, 0)
    # Both dead engines were replaced and the run went on to its last step on their successors.
    assert summary.steps == cfg.train.total_steps and sorted(engine_cks) == [2, 3]
    replaced = [e["reason"] for e in events(tmp_path) if e["reason"].startswith("engine ")]
    assert [r.split(";")[0] for r in replaced] == ["engine 0 died", "engine 1 died"], replaced
    check_common(
        *out, engines=[2, 3], rejected_ok=("unknown_prompt", "wrong_engine"),
        requeued=final.accounts.requeued, late_groups=True,
    )
    assert final.accounts.lost == 0
