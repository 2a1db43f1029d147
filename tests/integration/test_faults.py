"""SIGKILL of each kind of process in each phase of one real run (tiny model), on a machine kept busy by
CPU burners from each kill until its death is logged: a vLLM engine core (its Ray actor lives on)
between steps, an engine's Ray actor at a random moment, an engine core mid-weight-sync, the buffer
between steps and at a random moment. Random moments are drawn from a seeded generator and printed, so
a failure can be replayed. And engines and the buffer killed during an evaluation. Each death must be
found (logged by the run's watcher) within DETECT_S and acted on (its recovery logged) within ACT_S.
And hangs: an engine's actor and a learner rank stopped with SIGSTOP, found by their unanswered
liveness probes, and learner ranks SIGKILLed mid-weight-sync and mid-checkpoint, each recovered from
the newest complete checkpoint (a rank killed mid-step: test_elastic.py)."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import threading
import time

import msgspec
import psutil
import pytest
import ray
from _load import start_burners, stop_burners
from test_elastic import SHORT, _kill_after_first_bucket, events
from test_training_run import check_common, run_short

from async_rl.control import checkpoint as checkpoint_module
from async_rl.control.remote_cause import cause_line
from async_rl.control.start_retry import StartRetry
from async_rl.evaluation.phase import Evaluation
from async_rl.generator import pool as pool_module
from async_rl.generator.pool import GeneratorPool
from tests.integration._never_starts import NeverStarts

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]  # one Ray for the module

SEED = int(os.environ.get("FAULTS_SEED", "13"))
# A death is found (logged by the watcher, source 'watch') within DETECT_S of the kill, every core
# busy, wherever the loop is; its recovery (the supervisor's 'recovery' event) starts within ACT_S.
DETECT_S = 10.0
ACT_S = 10.0
MARGIN_S = 30.0  # a step may take the start-ups of the replacements that ran in it plus this


def found_since(run_dir, since: float) -> bool:
    """The run logged a death found at or after `since` (wall time): the watcher's, or a recovery."""
    try:
        return any(
            (e["source"] == "watch" or "died" in e["reason"]) and e["at"] >= since for e in events(run_dir)
        )
    except (FileNotFoundError, ValueError):  # no event yet, or the line being written
        return False


def burn_until_found(run_dir, since: float, procs: list) -> None:
    """Stop `procs` once a death at or after `since` is logged, or once the detection window (and
    2 s) passed."""
    deadline = time.monotonic() + DETECT_S + 2
    while time.monotonic() < deadline and not found_since(run_dir, since):
        time.sleep(0.1)
    stop_burners(procs)


class Killer:
    """SIGKILLs processes of a run by kind, each with every core kept busy from just before the kill
    until the watcher logged a death after it; remembers (label, kind, wall time) of every kill."""

    def __init__(self, run_dir) -> None:
        self.run_dir = run_dir
        self.kills: list[tuple[str, str, float]] = []
        self.burners: list = []

    def pids(self, controller, kind: str) -> list[int]:
        if kind == "buffer":
            return [ray.get(controller.buffer.pid.remote(), timeout=60)]
        victim = controller.generators.pids()[sorted(controller.generators.engines)[0]]
        return victim.engine_core if kind == "engine_core" else [victim.actor]

    def kill(self, label: str, kind: str, pids: list[int]) -> None:
        procs = start_burners()
        self.burners.extend(procs)
        at = time.time()
        self.kills.append((label, kind, at))
        threading.Thread(target=burn_until_found, args=(self.run_dir, at, procs), daemon=True).start()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        stop_burners(self.burners)


def found_and_acted(log: list[dict], at: float, watched: str, recovered: str) -> tuple[float, float]:
    """Seconds from a kill at wall time `at` to its death being found and to its recovery: the first
    'recovery' event after it whose reason starts with `recovered` and says "died". Found: the watcher's
    'watch' event whose reason starts with `watched`, or the recovery itself when another path (a failed
    call, the health check) got there first; the watcher then stays silent about a process already
    taken out of the run (docs/faults.md). No such recovery fails with every event logged since `at`."""
    since = [e for e in log if e["at"] >= at]
    acted = next(
        (e["at"] for e in since if e["source"] == "recovery" and e["reason"].startswith(recovered) and "died" in e["reason"]),
        None,
    )
    assert acted is not None, (
        f"no recovery of {recovered.strip()!r} logged after the kill at {at:.2f}; the events since:\n"
        + ("\n".join(json.dumps(e) for e in since) or "none")
    )
    found = [e["at"] for e in since if e["source"] == "watch" and e["at"] <= acted and e["reason"].startswith(watched)]
    return min([acted, *found]) - at, acted - at


def delays(log: list[dict], kills: list[tuple[str, str, float]]) -> dict[str, tuple[float, float]]:
    """For every kill: seconds to its death being found and to its recovery (found_and_acted, the
    first 'recovery' event for its kind after it)."""
    out = {}
    for label, kind, at in kills:
        name = {"buffer": "buffer", "learner": "learner "}.get(kind, "engine ")
        out[label] = found_and_acted(log, at, name, name)
    return out


def startups(log: list[dict]) -> list[tuple[float, float]]:
    """(start, end) wall times of every replacement engine's start-up: from a dead engine's recovery
    to the first 'started engine' event after it (with a survivor it starts in the background, and
    the steps it overlaps need not wait for it: counting it is an upper bound)."""
    started = [e["at"] for e in log if e["reason"].startswith("started engine")]
    replaced = [e["at"] for e in log if e["source"] == "recovery" and e["reason"].startswith("engine ")]
    return [(d, min(t for t in started if t >= d)) for d in replaced]


def held_up(bounds: dict[int, float], ups: list[tuple[float, float]], kills) -> list[str]:
    """Every step (after the first) whose wall time, less the replacement start-ups that ran in it,
    reached MARGIN_S: one line each naming the step, the kills that landed in it and the times. A
    step can hold two start-ups (the engine actor killed at a random moment just before step 6, and
    the engine core killed mid-way through step 6's sync: 67.8 s in CI on 2026-11-26)."""
    out = []
    for step in sorted(bounds)[1:]:
        t0, t1 = bounds[step - 1], bounds[step]
        spent = [b - a for a, b in ups if t0 <= b <= t1]
        if t1 - t0 - sum(spent) >= MARGIN_S:
            landed = [label for label, _, at in kills if t0 <= at <= t1] or ["none"]
            out.append(
                f"step {step + 1} took {t1 - t0:.1f}s, {t1 - t0 - sum(spent):.1f}s past its replacements' "
                f"start-ups {[round(s, 1) for s in spent]} (bound {MARGIN_S:.0f}s); kills in it: {', '.join(landed)}"
            )
    return out


def test_sigkill_each_kind_in_each_phase_is_found_and_acted_on_within_seconds(tmp_path, model_cache, monkeypatch):
    """Engine cores, engine actors and the buffer killed between steps, at random moments and mid-sync:
    each found and acted on within seconds, the run completes balanced. A second fault in the training
    loop: the first replacement (engine 0's) is killed while it starts in the background; it is started
    again, counted in failed_starts, and the run goes on with the other engine meanwhile. A third: the
    first start after that kill runs out of memory at load (its KV cache larger than the machine's free
    memory, vLLM's own check); it is started again and counted too."""
    rng = random.Random(SEED)
    timed = {3: "engine_actor", 7: "buffer"}  # a random moment after step k: mid-step, a sync, a lease
    at = {k: rng.uniform(0.0, 3.0) for k in timed}
    print(f"faults seed {SEED}: " + ", ".join(f"{timed[k]} {at[k]:.2f}s after step {k + 1}" for k in timed))
    between_kills = {1: "engine_core", 5: "buffer"}  # right after step k's sync, before step k + 2 starts
    sync_kill = 6  # the update to version 6: an engine core dies once its first bucket left the sender
    killer = Killer(tmp_path)
    fired = {k: threading.Event() for k in timed}
    real_broadcast = GeneratorPool._broadcast

    def strike_mid_sync(self, sender, actors, version):
        if version == sync_kill and not any(label == "engine_core mid-sync" for label, _, _ in killer.kills):
            victim = sorted(self.engines)[0]
            pids = ray.get(self.engines[victim].actor.pids.remote(), timeout=60).engine_core
            # the burners and the clock start here; the kill itself lands after the first bucket
            hook = _kill_after_first_bucket(pids, version, tmp_path / "struck_at_bucket")
            ray.get(sender.__ray_call__.remote(lambda rank: rank.weights.on_bucket(hook)), timeout=60)
            killer.kill("engine_core mid-sync", "engine_core", [])
        return real_broadcast(self, sender, actors, version)

    monkeypatch.setattr(GeneratorPool, "_broadcast", strike_mid_sync)
    real_launch = GeneratorPool.launch
    struck: list[tuple[int, float]] = []  # the first replacement, killed while it starts in the training loop
    aimed: list[int] = []

    causes: list[str] = []  # the cause of every failed start, as the run's line gives it
    real_failed_start = StartRetry.failed_start

    def failed_start(self, attempt, what, exc, say):
        causes.append(cause_line(exc))
        return real_failed_start(self, attempt, what, exc, say)

    monkeypatch.setattr(StartRetry, "failed_start", failed_start)
    oom: list[int] = []  # the first start after that kill: out of memory at load (a KV cache bigger than the machine)

    def launch_and_strike(self, count, paused):
        if struck and not oom:
            real_settings = self.make_settings

            def too_big_a_kv_cache(engine_id):
                # vLLM's CPU worker refuses a KV cache larger than the free memory once the model is loaded
                settings = real_settings(engine_id)
                return msgspec.structs.replace(settings, spec=msgspec.structs.replace(settings.spec, kv_cache_bytes=2**50))

            self.make_settings = too_big_a_kv_cache
            try:
                new = real_launch(self, count, paused)
            finally:
                self.make_settings = real_settings
            oom.append(new[0])
            return new
        new = real_launch(self, count, paused)
        if not aimed:  # engine 0's replacement after its core died (step 2): its actor dies 2 s into its start
            aimed.append(new[0])  # at once: another replacement may be launched within those 2 s
            actor = self.starting[new[0]].handle.actor  # vLLM takes >10 s to start here: not yet serving

            def strike():
                struck.append((new[0], time.time()))
                ray.kill(actor, no_restart=True)

            threading.Timer(2.0, strike).start()
        return new

    monkeypatch.setattr(GeneratorPool, "launch", launch_and_strike)

    def kill_later(controller, k: int) -> None:
        kind = timed[k]
        killer.kill(f"{kind} at a random moment", kind, killer.pids(controller, kind))
        fired[k].set()

    ends: dict[int, float] = {}  # wall time each step's loop turn ended (its sync, evaluation and hook)

    def between(controller, step):
        ends[step] = time.time()
        # A kill scheduled earlier must land while the run goes on: on a quiet machine a step takes
        # ~0.2 s, so without this wait a kill drawn 3 s out would come after the last step.
        for k in timed:
            if k < step:
                assert fired[k].wait(30), f"the {timed[k]} kill never fired"
        if step in between_kills:
            kind = between_kills[step]
            killer.kill(f"{kind} between steps", kind, killer.pids(controller, kind))
        if step in timed:  # a timer, so the kill lands wherever the run is then (step, sync, lease)
            threading.Timer(at[step], kill_later, (controller, step)).start()

    try:
        out = run_short(
            tmp_path, model_cache, [*SHORT, "train.total_steps=10", "generators.num_engines=2"], between=between
        )
    finally:
        killer.stop()
    cfg, summary, _, engine_cks, final, records = out
    assert sorted(label for label, _, _ in killer.kills) == sorted([
        "engine_core between steps", "engine_actor at a random moment", "engine_core mid-sync",
        "buffer between steps", "buffer at a random moment",
    ])
    assert (tmp_path / "struck_at_bucket").read_text().startswith("1/")  # the core died mid-update
    log = events(tmp_path)
    took = delays(log, killer.kills)
    print("found / acted on, s:", {label: (round(f, 2), round(a, 2)) for label, (f, a) in took.items()})
    late = [
        f"{label}: found {f:.2f}s, acted on {a:.2f}s after the kill (bounds {DETECT_S:.0f}s, {ACT_S:.0f}s)"
        for label, (f, a) in took.items() if not (0 <= f < DETECT_S and 0 <= a < ACT_S)
    ]
    assert not late, "; ".join(late)
    # No step held up longer than the replacements' start-ups that ran in it (measured here) plus a margin.
    ups = startups(log)
    steps = [records[0]["elapsed_s"]] + [b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(records)]
    print(f"replacement start-ups {[round(b - a, 1) for a, b in ups]}s; step times", [round(s, 1) for s in steps])
    slow = held_up(ends, ups, killer.kills)
    assert not slow, "; ".join(slow)
    # A replacement starts in the background while the other engine generates: steps end during start-ups.
    went_on = [sum(a < t < b for t in ends.values()) for a, b in ups]
    print(f"steps ended while each replacement started: {went_on}")
    assert any(went_on), (ups, ends)
    # The first replacement, killed while it started, was started again (counted) and joined the pool.
    (struck_id, struck_at), = struck
    assert not [e for e in log if "start(s) failed" in e["reason"]], log  # started again, never given up
    joined = [e["at"] - struck_at for e in log if e["at"] > struck_at and e["reason"].startswith("started engine ")]
    print(f"replacement {struck_id} killed while it started: a replacement joined {joined[0]:.1f}s later")
    # The first start after it ran out of memory at load (vLLM's own check, read back from the engine
    # core's log): started again, counted.
    assert oom and len(causes) == 2 and "less than requested memory for kv" in causes[1], causes
    print(f"engine {oom[0]} out of memory at load: {causes[1]}")
    assert records[-1]["failed_starts"] == 2 and {struck_id, *oom}.isdisjoint(engine_cks), (records[-1], sorted(engine_cks))
    # Every process is back: two engines hold the learner's weights, every step trained a full batch,
    # the accounting balances and nothing was lost (dead engines' and the dead buffer's leases requeued).
    # A step held up by a recovery lets groups leased before it go stale: dropped in whole groups.
    check_common(
        *out, engines=sorted(engine_cks), rejected_ok=("unknown_prompt", "wrong_engine"),
        requeued=final.accounts.requeued, late_groups=True,
    )
    assert len(engine_cks) == 2 and summary.steps == cfg.train.total_steps
    # Nothing lost while the run went on (the dead engines' and buffers' leases were requeued); what
    # the shutdown loses is the requests then in flight, in whole groups (check_common), which a
    # buffer restarted in the last step (its snapshot older than the last leases) makes likely.
    assert records[-1]["lost"] == 0
    # Nothing trained twice: exactly one batch per step was acknowledged.
    batch = cfg.train.prompts_per_step * cfg.generators.group_size
    assert final.accounts.trained == batch * cfg.train.total_steps


def test_evaluation_survives_an_engine_dying_mid_evaluation(tmp_path, model_cache, monkeypatch):
    """Two engines, evaluations at the start, after step 2 and at the end. In the first, engine 0's
    vLLM engine core is killed before its share reaches it; in the second, the buffer; in the last,
    an engine's Ray actor with its share in flight. Each time exactly the dead engine's prompts go to
    the other engine, the record counts them, every eval prompt is scored once, the dead engine is
    replaced and the buffer restarted: the run goes on. Every death is found within DETECT_S. A second
    fault during the first recovery: engine 0's replacement is killed while it starts (in the background,
    while engine 1 serves); it is started again (generators.start_attempts), counted in failed_starts, and
    the evaluation and the steps go on with engine 1 (the hook after step 2 waits for the replacement, so
    the last evaluation has two engines again). And a third:
    while that replacement starts, a reward worker of the engine left is SIGKILLed; its pool starts
    another (a call it held scores 0, counted), and that engine serves on, never taken for dead."""
    real = Evaluation._dispatch
    real_launch = GeneratorPool.launch
    struck: list[int] = []  # the replacement engine killed while it started
    reward_killed: list[tuple[int, int]] = []  # (engine id, pid) of the reward worker killed meanwhile

    def reward_workers(actor_pid: int) -> list[int]:
        """The pids of an engine's reward workers: the processes its fork server forked (the actor's
        grandchildren); [] once the actor is gone."""
        try:
            return [w.pid for c in psutil.Process(actor_pid).children()
                    if "multiprocessing.forkserver" in " ".join(c.cmdline()) for w in c.children()]
        except psutil.Error:
            return []

    def kill_a_reward_worker(engine_id: int, actor) -> None:
        """SIGKILL one reward worker of an engine, then watch (on a thread) for its pool to be whole
        again: as many workers as before, the killed one not among them (pebble replaced it, or the
        pool was restarted at its next call)."""
        actor_pid = ray.get(actor.pids.remote(), timeout=60).actor
        workers = reward_workers(actor_pid)
        if not workers:
            return
        reward_killed.append((engine_id, workers[0]))
        kill_times["reward_worker"] = time.time()
        os.kill(workers[0], signal.SIGKILL)

        def watch() -> None:
            while psutil.pid_exists(actor_pid):
                now = reward_workers(actor_pid)
                if len(now) >= len(workers) and workers[0] not in now:
                    kill_times["reward_pool_whole"] = time.time()
                    return
                time.sleep(0.1)

        threading.Thread(target=watch, daemon=True).start()

    def launch(self, count, paused):
        new = real_launch(self, count, paused)  # started in the background: engine 1 serves meanwhile
        if "engine_core" in kill_times and not struck:  # the first evaluation's dead engine is being replaced
            (left,) = self.engines  # the engine not being replaced
            starting = self.starting[new[0]].handle.actor

            def strike():
                kill_a_reward_worker(left, self.engines[left].actor)
                time.sleep(2.0)  # into its start (vLLM takes >10 s to start here): not yet serving
                kill_times["replacement"] = time.time()
                struck.append(new[0])
                ray.kill(starting, no_restart=True)

            threading.Thread(target=strike, daemon=True).start()
        return new

    monkeypatch.setattr(GeneratorPool, "launch", launch)
    sent: list[tuple[int, int, list[int]]] = []  # (evaluation: its last_step, engine id, prompt ids)
    killed: list[tuple[str, int, list[int]]] = []  # (what, engine id, the prompts it held)
    kill_times: dict[str, float] = {}

    def dispatch(self, engine, prompts):
        engine_id = ray.get(engine.stats.remote(), timeout=60).engine_id
        ids = [p.prompt_id for p in prompts]
        first = not any(e == self.last_step for e, _, _ in sent)
        sent.append((self.last_step, engine_id, ids))
        pids = ray.get(engine.pids.remote(), timeout=60)
        if first and self.last_step == -1:  # the first evaluation: its engine core dies
            kill_times["engine_core"] = time.time()
            for pid in pids.engine_core:
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while ray.get(engine.healthy.remote(), timeout=60):  # the actor has seen it die
                assert time.monotonic() < deadline, "the engine never noticed its core died"
                time.sleep(0.1)
            killed.append(("engine_core", engine_id, ids))
        ref = real(self, engine, prompts)
        if first and self.last_step == 0:  # the evaluation after step 2: the buffer dies meanwhile
            kill_times["buffer"] = time.time()
            os.kill(buffer_pid[0], signal.SIGKILL)
        if first and self.last_step == 2:  # the last evaluation: the actor dies with its share in flight
            kill_times["engine_actor"] = time.time()
            os.kill(pids.actor, signal.SIGKILL)
            killed.append(("engine_actor", engine_id, ids))
        return ref

    monkeypatch.setattr(Evaluation, "_dispatch", dispatch)
    buffer_pid: list[int] = []

    def between(controller, step):
        # The buffer's pid, for the kill in the evaluation after step 2. Once killed, the handle may still
        # be the dead actor's when this runs (its death not yet found: the step had its batch already).
        if "buffer" not in kill_times:
            buffer_pid[:] = [ray.get(controller.buffer.pid.remote(), timeout=60)]
        if step == 1:  # engine 0's replacement starts in the background: the last evaluation needs it in the pool
            controller.supervisor.finish_refills(step, controller.version)

    evals = ["eval.enabled=true", "eval.max_prompts=6", "eval.n=2", "eval.temperature=1.0", "eval.every=2"]
    out = run_short(
        tmp_path, model_cache, [*SHORT, "train.total_steps=3", "generators.num_engines=2", "generators.start_backoff_s=1",
                                *evals], between=between
    )
    cfg, summary, _, engine_cks, final, records = out
    assert [(k, e) for k, e, _ in killed] == [("engine_core", 0), ("engine_actor", 1)], killed
    records_eval = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records_eval] == [0, 2, 3]
    for (_, dead, held), evaluation, record in zip(killed, (-1, 2), records_eval[::2], strict=True):
        # Exactly the dead engine's prompts were sent again, to the engine left, and counted.
        again = [(e, ids) for s, e, ids in sent if s == evaluation][2:]
        assert len(again) == 1 and again[0][0] != dead and again[0][1] == held, sent
        assert record["reassigned_prompts"] == len(held) == 3 and record["dead_engines"] == 1
        # Every eval prompt scored exactly once (the phase checks the ids), none counted failed.
        assert (record["prompts"], record["samples"], record["failed_prompts"]) == (6, 12, 0)
    # Both dead engines were replaced and the run went on to its last step on their successors; engine
    # 0's first replacement (2) was killed while it started, and the second start (3) took its place.
    assert struck == [2] and records[-1]["failed_starts"] == 1
    # the reward worker of engine 1 killed while engine 0's replacement started: its pool went on (a call
    # it held, if any, scored 0 as a crash, or the pool was restarted), and engine 1 served on until its
    # planned death in the last evaluation (no other death of it below)
    assert [e for e, _ in reward_killed] == [1] and not psutil.pid_exists(reward_killed[0][1])
    assert "reward_pool_whole" in kill_times, "engine 1's reward pool never had its workers again"
    print(f"reward worker killed: its pool whole again {kill_times['reward_pool_whole'] - kill_times['reward_worker']:.1f}s "
          f"after the kill; crashes {records[-1]['reward_crashes']}, pool restarts {records[-1]['reward_pool_restarts']}")
    assert records[-1]["reward_crashes"] + records[-1]["reward_pool_restarts"] <= 2, records[-1]
    assert summary.steps == cfg.train.total_steps and sorted(engine_cks) == [3, 4]
    log = events(tmp_path)
    replaced = [e["reason"] for e in log if e["source"] == "recovery" and e["reason"].startswith("engine ")]
    assert [r.split(";")[0] for r in replaced] == ["engine 0 died", "engine 1 died"], replaced
    (back,) = [e for e in log if e["source"] == "recovery" and e["reason"].startswith("started engine 3 (")]
    print(f"replacement killed while starting: back {back['at'] - kill_times['replacement']:.1f}s after the kill")
    assert any(e["source"] == "recovery" and e["reason"].startswith("buffer died") for e in log)
    assert (records_eval[1]["reassigned_prompts"], records_eval[1]["failed_prompts"]) == (0, 0)  # no engine lost
    # Found: the watcher's event, or the recovery itself where the evaluation's failed call got there
    # first (the dead engine is then out of the run and the watcher says nothing about it).
    kills = [("engine_core", "engine", kill_times["engine_core"]), ("engine_actor", "engine", kill_times["engine_actor"]),
             ("buffer", "buffer", kill_times["buffer"])]
    found = {label: found for label, (found, _) in delays(log, kills).items()}
    print("found mid-evaluation, s:", {k: round(v, 2) for k, v in found.items()})
    assert all(0 <= v < DETECT_S for v in found.values()), found
    # The engine killed in the final evaluation (after the last step's record) may hold training leases:
    # they are requeued then, counted in the final accounts but in no step's record.
    (last_death,) = [e["reason"] for e in log if e["source"] == "recovery" and e["reason"].startswith("engine 1 died")]
    requeued_late = int(last_death.split("; ")[1].split()[0]) * cfg.generators.group_size
    check_common(
        *out, engines=[3, 4], rejected_ok=("unknown_prompt", "wrong_engine"),
        requeued=final.accounts.requeued, late_groups=True, requeued_after_last_step=requeued_late,
    )
    assert final.accounts.lost == 0


HANG_S = 8.0  # generators.unresponsive_s in the hang test: a probe unanswered this long is a death


def rank_pid(controller, rank: int) -> int:
    return ray.get(controller.learner.actors[rank].__ray_call__.remote(lambda actor: os.getpid()), timeout=60)


def test_learner_and_engine_hangs_and_learner_kills_mid_sync_and_mid_checkpoint_are_recovered(
    tmp_path, model_cache, monkeypatch
):
    """A stopped process keeps every call to it pending and never dies: its unanswered liveness
    probe names it. An engine's actor stopped between steps is replaced and the run goes on; a
    learner rank stopped later is a dead rank: its group restarts from the newest checkpoint. Then,
    in the replayed steps, learner rank 0 is SIGKILLed in the weight sync to version 4 (after its
    first bucket left) and rank 1 once checkpoint step_4's `.tmp-` folder exists: each time the group
    restarts from step_2 (never from the partial folder, which is removed) and the run completes every
    step with exact accounting. The kills are timed with every core busy (Killer)."""
    stopped: list[tuple[str, int, float]] = []  # (kind, pid, wall time)
    ctl: list = []
    killer = Killer(tmp_path)
    labels = lambda: [label for label, _, _ in killer.kills]  # noqa: E731
    real_broadcast = GeneratorPool._broadcast

    def strike_mid_sync(self, sender, actors, version):
        if version == 4 and stopped[-1:] and stopped[-1][0] == "learner" and "learner mid-sync" not in labels():
            hook = _kill_after_first_bucket(None, version, tmp_path / "struck_at_bucket")  # rank 0 itself
            ray.get(sender.__ray_call__.remote(lambda rank: rank.weights.on_bucket(hook)), timeout=60)
            killer.kill("learner mid-sync", "learner", [])  # the burners and the clock start here
        return real_broadcast(self, sender, actors, version)

    real_begin = checkpoint_module.begin
    cut_short: list = []

    def strike_mid_checkpoint(run_dir):
        tmp = real_begin(run_dir)
        if "learner mid-sync" in labels() and "learner mid-checkpoint" not in labels():
            cut_short.append(tmp)  # the ranks are asked to write into it right after
            killer.kill("learner mid-checkpoint", "learner", [rank_pid(ctl[0], 1)])
        return tmp

    monkeypatch.setattr(GeneratorPool, "_broadcast", strike_mid_sync)
    monkeypatch.setattr(checkpoint_module, "begin", strike_mid_checkpoint)

    def between(controller, step):
        ctl[:] = [controller]
        if step == 0 and not stopped:
            pid = controller.generators.pids()[0].actor
            stopped.append(("engine", pid, time.time()))
            os.kill(pid, signal.SIGSTOP)
        if step == 2 and len(stopped) == 1:
            pid = rank_pid(controller, 1)
            stopped.append(("learner", pid, time.time()))
            os.kill(pid, signal.SIGSTOP)

    overrides = [
        *SHORT, "train.total_steps=5", "learner.world_size=2", f"generators.unresponsive_s={HANG_S}",
        "train.checkpoint_every=2",
    ]
    try:
        cfg, summary, learner_ck, engine_cks, final, records = run_short(tmp_path, model_cache, overrides, between=between)
    finally:
        killer.stop()
        for _, pid, _ in stopped:  # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert [kind for kind, _, _ in stopped] == ["engine", "learner"]
    assert labels() == ["learner mid-sync", "learner mid-checkpoint"]
    assert (tmp_path / "struck_at_bucket").read_text().startswith("1/")  # rank 0 died mid-update
    log = events(tmp_path)
    found = {
        kind: next(e["at"] for e in log if e["source"] == "watch" and e["at"] >= t and e["reason"].startswith(kind)) - t
        for kind, _, t in stopped
    }
    print("hangs found after, s:", {k: round(v, 2) for k, v in found.items()})
    assert all(HANG_S <= v < HANG_S + DETECT_S for v in found.values()), found
    took = delays(log, killer.kills)
    print("learner kills found / acted on, s:", {label: (round(f, 2), round(a, 2)) for label, (f, a) in took.items()})
    assert all(0 <= f < DETECT_S and 0 <= a < ACT_S for f, a in took.values()), took
    recovered = [e["reason"] for e in log if e["source"] == "recovery"]
    assert recovered[0].startswith("engine 0 died") and recovered[1] == "starting engine(s) [1] in its place", recovered
    assert recovered[2].startswith("started engine 1 ("), recovered  # the only engine: the run waited for it
    assert recovered[3].startswith("learner rank 1 died (no answer to a liveness probe for"), recovered
    assert recovered[4].startswith("learner rank 0 died ("), recovered
    assert recovered[5].startswith("learner rank 1 died ("), recovered
    for n, reason in enumerate(recovered[3:], start=1):  # never from the partial step_4
        assert reason.endswith(f"from {tmp_path / 'checkpoints' / 'step_2'} (step 2, recovery {n})"), recovered
    assert len(recovered) == 6, recovered
    # The checkpoint cut short is gone, and step_4 and step_5 were written again in full.
    assert cut_short and not cut_short[0].exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4", "step_5"]
    # Step 4 hung (rank 1 stopped in it): steps 3-5 again from step_2; step 4's sync lost its sender
    # (step 4 unlogged): again from step_2; step 4's checkpoint lost rank 1 (step 4 logged): again.
    assert [(r["step"], r["replayed"], r["recoveries"]) for r in records] == [
        (0, False, 0), (1, False, 0), (2, False, 0), (2, True, 1), (2, True, 2), (3, False, 2),
        (2, True, 3), (3, True, 3), (4, False, 3),
    ]
    assert (summary.steps, summary.final_version) == (5, 5)
    for ck in engine_cks.values():
        assert ck.close_to(learner_ck), (ck, learner_ck)
    # Exact accounting, nothing trained twice: ten batches acknowledged (steps 1-3, 3-4, 3-4, 3-5),
    # each of fresh groups (an acknowledged batch leaves the buffer).
    batch, group = cfg.train.prompts_per_step * cfg.generators.group_size, cfg.generators.group_size
    a = final.accounts
    assert a.balanced() and (a.in_flight, a.trained, a.filtered) == (0, 10 * batch, 0)
    assert (a.lost + a.dropped_stale) % group == 0
    assert a.leased == a.trained + a.dropped_stale + a.filtered + a.lost + a.requeued + a.waiting


def test_an_engine_start_that_never_returns_times_out_and_its_actor_is_stopped(monkeypatch):
    """The background start's own timeout (generator/pool.py TIMEOUT_S: 600 s, 2 s here): an engine
    whose start never returns (its core wedged while initializing) fails with a TimeoutError naming
    it, leaves the pool, and its actor and its room are stopped. The supervisor starts it again like
    any failed start (tests/unit/test_refills.py)."""
    monkeypatch.setattr(pool_module, "TIMEOUT_S", 2.0)
    pool = GeneratorPool(lambda engine_id: None, None, 1, 1, 10.0, actor_cls=NeverStarts)
    (engine_id,) = pool.launch(1, paused=True)
    actor, room = pool.starting[engine_id].handle.actor, pool.starting[engine_id].handle.pool
    launched = time.monotonic()
    joined, failed = pool.poll_starts()
    while not failed:
        assert not joined and time.monotonic() - launched < 60, "the start never timed out"
        time.sleep(0.2)
        joined, failed = pool.poll_starts()
    assert time.monotonic() - launched >= 2.0
    ((failed_id, why),) = failed
    assert failed_id == engine_id and isinstance(why, TimeoutError), failed
    assert str(why) == f"engine {engine_id} did not start within 2s"
    assert not pool.starting and not pool.engines and not joined
    with pytest.raises(ray.exceptions.RayActorError):  # stopped, not left wedged
        ray.get(actor.shutdown.remote(), timeout=60)
    assert ray.util.placement_group_table(room.pg)["state"] == "REMOVED"
