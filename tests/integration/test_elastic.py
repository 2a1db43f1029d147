"""Elastic generator pool in real runs: the operator's scale command, and processes killed with
SIGKILL (an engine mid-generation and mid-weight-sync, the buffer) while training goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
from test_training_run import REPO, check_common, run_short

from async_rl.control.runtime import Runtime
from async_rl.generator.pool import GeneratorPool
from async_rl.weight_sync.base import SendProgress

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]  # one Ray for the module

DETECT_S = 10.0  # a death is noticed within this, on a busy machine too

SHORT = [
    "train.total_steps=6",
    "train.max_lag=1",
    "train.prompts_per_step=4",
    "generators.group_size=4",
    "generators.health_check_s=1",
    "weight_sync.timeout_s=30",  # a sync to a dead receiver fails within this
    "weight_sync.bucket_mb=1",  # tiny-qwen2 in more than one bucket: a kill can land between two
]


def scale(run_dir: Path, engines: int) -> subprocess.Popen:
    """`python -m async_rl.control.scale` as an operator runs it; returns once its request is on disk."""
    requests = run_dir / "control" / "requests"
    before = set(requests.glob("*.json"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "async_rl.control.scale", str(run_dir), "--engines", str(engines), "--timeout", "600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.monotonic() + 60
    while not set(requests.glob("*.json")) - before:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the scale command wrote no request"
        time.sleep(0.05)
    return proc


def finished(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out


def kill_engine(controller, engine_id: int) -> None:
    """SIGKILL the engine's Ray actor process, then vLLM's processes under it."""
    pids = controller.generators.pids()[engine_id]
    for pid in [pids.actor, *pids.engine_core]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "scaling.jsonl").read_text().splitlines()]


def test_scale_command_up_and_down_and_buffer_restart(tmp_path, model_cache):
    procs: dict[str, subprocess.Popen] = {}
    pools: list[list[int]] = []

    def between(controller, step):
        if step == 0:
            procs["up"] = scale(tmp_path, 2)  # answered between steps 1 and 2
        if step == 1:
            assert "engines 1 -> 2" in finished(procs["up"])
            pools.append(sorted(controller.generators.engines))
            procs["down"] = scale(tmp_path, 1)
        if step == 2:
            assert "engines 2 -> 1" in finished(procs["down"])
            pools.append(sorted(controller.generators.engines))
            os.kill(ray.get(controller.buffer.pid.remote()), signal.SIGKILL)  # restarted from its snapshot

    out = run_short(tmp_path, model_cache, SHORT, between=between)
    # The added engine generated with the learner's weights; the newest engine was drained and removed.
    assert pools == [[0, 1], [0]]
    # The drained engine handed its leases back (requeued, whole groups of 4); the count depends on
    # timing, the other buckets do not.
    requeued = out[4].accounts.requeued
    assert requeued % 4 == 0
    check_common(*out, engines=[0], rejected_ok=("unknown_prompt", "wrong_engine"), requeued=requeued)
    records = out[-1]
    assert [r["num_engines"] for r in records][:4] == [1, 1, 2, 1]  # logged before the change applies
    assert all(r["lost"] == 0 for r in records)  # drained and restarted: handed back, never lost
    log = events(tmp_path)
    # The drained engine's end is no death: the run's watcher reported only the buffer's.
    assert [e["reason"].split(":")[0] for e in log if e["source"] == "watch"] == ["buffer found dead"]
    log = [e for e in log if e["source"] != "watch"]
    assert [(e["source"], e["engines_before"], e["engines_after"]) for e in log] == [
        ("operator", 1, 2),
        ("operator", 2, 1),
        ("recovery", 1, 1),
    ]
    assert "buffer died; restarting it from" in log[2]["reason"]
    assert not (tmp_path / "control.json").exists()  # a finished run is not 'running'


def _kill_after_first_bucket(pids: list[int] | None, version: int, record: Path):
    """A sender hook (it runs in learner rank 0): SIGKILL `pids` (None: the sender itself) once the
    first bucket of update `version` has left the sender, once; `record` says how far that update
    was (written first: the sender may be the one killed)."""
    fired: list[bool] = []

    def hook(progress: SendProgress) -> None:
        if progress.version == version and progress.buckets_sent == 1 and not fired:
            fired.append(True)
            record.write_text(f"{progress.buckets_sent}/{progress.buckets_total}")
            for pid in [os.getpid()] if pids is None else pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    return hook


def test_engine_sigkill_mid_generation_and_mid_weight_sync(tmp_path, model_cache, monkeypatch):
    struck: list[int] = []
    record = tmp_path / "struck_at_bucket"
    real_broadcast = GeneratorPool._broadcast

    def strike_mid_sync(self, sender, actors, version):
        # The engines are paused and the group is formed; one dies once the first bucket has moved.
        if version == 4 and not struck:
            victim = sorted(self.engines)[0]
            pids = ray.get(self.engines[victim].actor.pids.remote())
            hook = _kill_after_first_bucket([pids.actor, *pids.engine_core], version, record)
            ray.get(sender.__ray_call__.remote(lambda rank: rank.weights.on_bucket(hook)))
            struck.append(victim)
        return real_broadcast(self, sender, actors, version)

    monkeypatch.setattr(GeneratorPool, "_broadcast", strike_mid_sync)

    def between(controller, step):
        if step == 0:
            kill_engine(controller, 0)  # mid-generation: it holds leases and requests in flight

    slow = ["task.name=tests.integration._slow_task:make_task", "task.reward_workers=16", "task.reward_timeout_s=10"]
    out = run_short(tmp_path, model_cache, [*SHORT, *slow], between=between)
    assert struck == [1]  # the replacement of engine 0 was the one killed mid-sync
    sent, total = map(int, record.read_text().split("/"))
    assert sent == 1 and total > 1  # killed with the update under way: a bucket moved, others not
    log = [e for e in events(tmp_path) if e["source"] != "watch"]  # the deaths as acted on
    died = [e for e in log if "died" in e["reason"]]
    assert [e["reason"].split(";")[0] for e in died] == ["engine 0 died", "engine 1 died"]
    requeued = sum(int(e["reason"].split(";")[1].split()[0]) for e in died)
    assert requeued > 0  # slow rewards: the engines held leases when they died
    # Engine 2 replaced it; it holds exactly the learner's weights and the run reached its last step.
    # Every handed-back lease is in the ledger as requeued (4 samples each), none lost. A group may
    # arrive late and be dropped stale, whole: the sync of version 4 waits for engine 1's death to be
    # found and engine 2 to start (55 s in a CI run on a loaded machine), while a group leased before
    # it is still being scored at 0.5 s a sample; the step before it may train without it.
    check_common(*out, engines=[2], rejected_ok=("unknown_prompt", "wrong_engine"), requeued=4 * requeued,
                 late_groups=True)
    assert [e["source"] for e in log] == ["recovery"] * 6  # died, starting, replaced; twice


def test_learner_rank_sigkilled_mid_step_is_recovered_from_the_checkpoint(tmp_path, model_cache, monkeypatch):
    """Rank 1 of 2 dies mid-step 4 (index 3); the group restarts on fresh actors from step_2, steps
    3 and 4 are trained again, and the run ends with every step, the engines on the learner's weights.
    Second faults during that recovery: a rank of the new group is SIGKILLed while it starts (another
    recovery, within train.max_recoveries: the group starts again); then the run's only engine is
    SIGKILLed once the new group is up, before the recovery's weight sync; the sync finds it dead, a
    replacement starts and gets the restored weights, and the recovery goes on. And before all that, the
    run's first start of its engine fails (its actor killed while vLLM starts): it is started again
    (generators.start_attempts)."""
    killed: list[tuple[int, float]] = []  # (pid, wall time) of the rank killed
    ranks: list[int] = []  # the pids of every rank of the first group
    real_start = Runtime.start_train_step
    real_restart = Runtime.restart_learner
    engine_killed: list[float] = []
    new_rank_killed: list[tuple[int, float]] = []  # a rank of the restarting group, killed while it starts

    real_add = GeneratorPool.add
    first_start: list[int] = []  # the engine killed while the run's first start was under way

    def add_and_kill_the_first_start(pool, count, paused, while_starting=None):
        if not first_start:
            def kill_when_started():
                if while_starting is not None:
                    while_starting()
                (engine_id,) = pool.engines
                first_start.append(engine_id)
                ray.kill(pool.engines[engine_id].actor, no_restart=True)
            return real_add(pool, count, paused, kill_when_started)
        return real_add(pool, count, paused, while_starting)

    def kill_a_starting_rank() -> None:
        """SIGKILL the first learner rank of a new group (a process of this test's Ray, not of the first
        group) as soon as its actor exists: it dies in its start-up (imports, model load), seconds long."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for proc in psutil.Process().children(recursive=True):  # this test's Ray only
                try:
                    title = proc.cmdline()[:1]
                except psutil.Error:
                    continue
                if title and title[0].startswith("ray::LearnerDriver") and proc.pid not in ranks:
                    new_rank_killed.append((proc.pid, time.time()))
                    os.kill(proc.pid, signal.SIGKILL)
                    return
            time.sleep(0.02)

    def restart_then_kill_the_engine(rt, checkpoint_dir, from_step):
        if not new_rank_killed:  # the first restart: one of its new ranks dies while it starts
            killer = threading.Thread(target=kill_a_starting_rank, daemon=True)
            killer.start()
            try:
                real_restart(rt, checkpoint_dir, from_step)
            finally:
                killer.join(timeout=130)
        else:
            real_restart(rt, checkpoint_dir, from_step)
        if not engine_killed:
            (pids,) = rt.generators.pids().values()  # the run's one engine (1: its first start failed)
            engine_killed.append(time.time())
            os.kill(pids.actor, signal.SIGKILL)

    def strike_mid_step(rt, step):
        refs = real_start(rt, step)
        if step == 3 and not killed:
            pids = [ray.get(a.__ray_call__.remote(lambda rank: os.getpid()), timeout=60) for a in rt.learner.actors]
            ranks.extend(pids)
            killed.append((pids[1], time.time()))
            os.kill(pids[1], signal.SIGKILL)  # its step call is running (the call above queued behind nothing)
        return refs

    monkeypatch.setattr(Runtime, "start_train_step", strike_mid_step)
    monkeypatch.setattr(Runtime, "restart_learner", restart_then_kill_the_engine)
    monkeypatch.setattr(GeneratorPool, "add", add_and_kill_the_first_start)
    overrides = [*SHORT, "train.total_steps=4", "learner.world_size=2", "train.checkpoint_every=2"]
    cfg, summary, learner_ck, engine_cks, final, records = run_short(tmp_path, model_cache, overrides)
    # Every step, the replayed one logged again (marked); the policy version ends where it would have.
    assert [(r["step"], r["version"], r["replayed"], r["recoveries"]) for r in records] == [
        (0, 1, False, 0), (1, 2, False, 0), (2, 3, False, 0), (2, 3, True, 2), (3, 4, False, 2)
    ]
    assert (summary.steps, summary.final_version) == (4, 4)
    assert all(e.version == 4 for e in summary.engines)
    for ck in engine_cks.values():  # the engines serve the restarted learner's weights
        assert ck.close_to(learner_ck), (ck, learner_ck)
    # Accounting exact: five batches acknowledged (steps 1-3, 3 again, 4), each of fresh groups (an
    # acknowledged batch leaves the buffer, a batch never acknowledged is served again), none twice.
    batch, group = 4 * 4, 4
    a = final.accounts
    assert a.balanced() and (a.in_flight, a.trained, a.filtered) == (0, 5 * batch, 0)
    assert (a.lost + a.dropped_stale) % group == 0 and a.requeued % group == 0  # the dead engine's leases: again
    assert a.leased == a.trained + a.dropped_stale + a.filtered + a.lost + a.requeued + a.waiting
    log = events(tmp_path)
    found = next(e for e in log if e["source"] == "watch" and e["reason"].startswith("learner 1 found dead"))
    assert 0 <= found["at"] - killed[0][1] < DETECT_S, (found, killed)
    recovered = [e for e in log if e["source"] == "recovery"]
    reasons = [e["reason"] for e in recovered]
    assert len(reasons) == 5 and reasons[0].startswith("learner rank 1 died ("), reasons
    assert f"restarting the learner group from {tmp_path / 'checkpoints' / 'step_2'} (step 2, recovery 1)" in reasons[0]
    # a rank of the new group killed while it started: the group started again, recovery 2 of max_recoveries
    assert len(new_rank_killed) == 1 and new_rank_killed[0][0] not in ranks
    assert reasons[1].startswith("a rank of the restarting learner group failed ("), reasons
    assert reasons[1].endswith(f"restarting the learner group again from {tmp_path / 'checkpoints' / 'step_2'} "
                               "(step 2, recovery 2)"), reasons
    # the first start failed once and was started again: engine 1 ran the run until the recovery
    assert first_start == [0] and records[-1]["failed_starts"] == 1
    # the second fault: the engine killed during the recovery is replaced (engine 2) and serves the weights
    # (no engine left: the run waited for it, said once)
    assert reasons[2].startswith("engine 1 died") and reasons[3] == "starting engine(s) [2] in its place", reasons
    assert reasons[4].startswith("started engine 2 (engine(s) replacing [1])"), reasons
    assert sorted(engine_cks) == [2]
    print(f"learner rank killed -> recovery begun: {recovered[0]['at'] - killed[0][1]:.1f}s; a new rank killed while "
          f"it started -> the group started again: {recovered[1]['at'] - new_rank_killed[0][1]:.1f}s; engine killed "
          f"in the recovery -> replacement started: {recovered[4]['at'] - engine_killed[0]:.1f}s")
    # No process of the first group is left behind (the survivor, stuck in the step's collective, too).
    for pid in ranks:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


def test_autoscaler_grows_a_starved_pool(tmp_path, model_cache):
    # Starved by construction: synchronous (max_lag 0), and every reward takes 0.5 s (16 samples a step on
    # 4 reward workers: about 2 s a batch, against a learner step of well under 1 s). With the tiny model's
    # instant rewards the learner waited 0.3-4% of a step in a loaded CI (2026-12-07), under the threshold.
    overrides = [
        *SHORT,
        "train.total_steps=4",
        "train.max_lag=0",
        "task.name=tests.integration._slow_task:make_task",
        "task.reward_workers=4",
        "task.reward_timeout_s=10",
        "generators.autoscale.enabled=true",
        "generators.autoscale.max_engines=2",
        "generators.autoscale.window_steps=1",
        "generators.autoscale.cooldown_steps=0",
        "generators.autoscale.grow_wait_frac=0.3",
        "generators.autoscale.shrink_wait_frac=0.0",
        "generators.autoscale.shrink_fill_batches=100",
    ]
    out = run_short(tmp_path, model_cache, overrides)
    check_common(*out, engines=[0, 1])
    log = events(tmp_path)
    assert [(e["source"], e["engines_before"], e["engines_after"]) for e in log] == [("autoscale", 1, 2)]
    assert "learner starved (learner wait" in log[0]["reason"]
    print(f"autoscale: {log[0]['reason']}")
    assert [r["num_engines"] for r in out[-1]][-1] == 2


def test_delta_sync_serves_the_learners_bf16_weights_with_an_engine_joined_and_one_replaced(tmp_path, model_cache):
    """weight_sync.delta=on with bf16 engines: after every sync (full or delta) each engine computes with
    exactly the learner's weights rounded to bf16 (checksum.engine_checksum against the learner's). A
    joined and a replaced engine each make a new membership, whose first update is full for everyone."""
    seen: list[tuple[int, list[int], bool]] = []

    def between(controller, step):
        learner, engines = controller.checksums()
        seen.append((step, sorted(engines), all(ck.close_to(learner) for ck in engines.values())))
        if step == 0:
            controller.add_engines(1)  # joins: the next sync is full
        if step == 2:
            controller.remove_engine(0)  # replaced by a fresh engine: the next sync is full again
            controller.add_engines(1)

    overrides = [
        "train.total_steps=5", "train.max_lag=1", "train.prompts_per_step=4", "generators.group_size=4",
        "generators.dtype=bfloat16", "weight_sync.delta=on", "weight_sync.bucket_mb=1",
    ]
    cfg, summary, learner_ck, engine_cks, final, records = run_short(tmp_path, model_cache, overrides, between)
    assert [r["version"] for r in records] == [1, 2, 3, 4, 5] and summary.final_version == 5
    assert all(e.version == 5 for e in summary.engines) and final.accounts.balanced()
    assert [r["sync_delta"] for r in records] == [False, False, True, False, True]
    full = max(r["sync_bytes"] for r in records)
    assert all(0 < r["sync_bytes"] < full for r in records if r["sync_delta"])
    assert all(r["delta_fallbacks"] == 0 for r in records)
    assert seen == [(0, [0], True), (1, [0, 1], True), (2, [0, 1], True), (3, [1, 2], True), (4, [1, 2], True)]
    assert sorted(engine_cks) == [1, 2] and all(ck.close_to(learner_ck) for ck in engine_cks.values())
