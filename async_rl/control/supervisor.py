"""Supervision of a run: death and recovery of its processes, and the pool size (operator and
autoscaler). It acts only through the Runtime (runtime.py), which owns every process handle, and never
touches the controller; the controller's loop calls it. What happens when:

- always (steps, weight syncs, evaluations, checkpoints and the gaps between them): a watcher
  thread (death_watch.py) keeps one `watch` call pending on the buffer, every engine, every learner
  rank and every reward-model replica. Ray fails it the moment the actor dies; an engine's also
  returns when its vLLM engine core's process exited (core_watch.py) or its reward pool is stuck.
  The death is logged at once (`scaling.jsonl`, source 'watch'), a weight sync in flight is aborted
  (it would wait for the dead member), and the loop acts on it at its next safe point: at once
  while the learner trains (the step's wait looks every WAKE_S), else right after the phase it is in.
  Every `generators.health_check_s` a full check runs besides while the learner trains.
  A dead engine (its Ray actor, or its vLLM engine core) is removed, its leases go back to
  the prompt pool (`requeued`; a late frame from it is rejected), and a replacement starts and gets
  the current weights at once (the learner rank serves a sync while it waits). A dead buffer is
  restarted from its last snapshot and engines and learner ranks reconnect to it.
- an engine dies during an evaluation: the eval prompts it holds no result for go to the engines
  left (or, with none left, to its replacement); the eval record counts them (`reassigned_prompts`)
  and the dead engine is replaced before training goes on.
- a weight sync fails: a member that dies mid-sync fails it within seconds (every member watches the
  group's abort key, see weight_sync/gloo.py; the pool aborts the group as soon as any call fails);
  dead members are found and replaced, the broadcast group is rebuilt, and the sync is retried for
  everyone left. A failure without a dead engine stops the run.
- a learner rank dies or hangs (train.recover=auto): every rank of the group is killed and started
  afresh in the same resources from the newest checkpoint (the initial weights at step 0 without one),
  the engines get its weights, and the loop goes on from that step (LearnerRestarted); the buffer keeps
  its waiting groups and accounting. Past train.max_recoveries, or with train.recover=off, the run
  stops with exit code 1 and one line naming the checkpoint to resume from (recovery.py).
- between steps: operator requests (`python -m async_rl.control.scale`) and, if enabled, the autoscaler set
  the pool size; added engines get the current weights before they generate, removed ones drain.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TextIO, TypeVar

import msgspec
import ray
from ray.actor import ActorHandle

from async_rl.buffer.actor import BufferStats
from async_rl.buffer.snapshot import SNAPSHOT_NAME
from async_rl.cluster.resources import actor_key
from async_rl.config import Config
from async_rl.control import checkpoint
from async_rl.control.autoscale import ScaleDecision, ScaleSignal, decide
from async_rl.control.death_watch import DeathNotice, DeathWatch, Target, Watched
from async_rl.control.failure_watch import Failing, FailureWatch, reward_name
from async_rl.control.operator_requests import ControlInbox, ScaleReply, ScaleRequest
from async_rl.control.recovery import LearnerRecovery, RestartPlan
from async_rl.control.refills import Refills
from async_rl.control.runtime import Runtime
from async_rl.control.start_retry import StartRetry, StartsSpent, engine_starts
from async_rl.errors import RunError, first_line
from async_rl.evaluation.scores import EvalRecord
from async_rl.generator.pool import LEARNER
from async_rl.learner.base import StepMetrics
from async_rl.weight_sync.base import NEEDS_FULL_UPDATE

SYNC_ATTEMPTS = 3
# A failed sync whose members all still look alive waits this long for the death that broke it: the
# survivors abandon the update the moment a peer's socket resets, and the watcher (or the engine's
# health check) sees the dead vLLM core a moment later, under load a few seconds later.
SYNC_DEATH_GRACE_S = 10.0
T = TypeVar("T")
START_TIMEOUT_S = 600.0
WAKE_S = 0.25  # while the learner trains, how often the supervisor looks for death notices
# A learner step's time limit: STEP_FACTOR x the slowest of the last STEP_WINDOW steps, at least
# STEP_FLOOR_S (a step may wait for a replaced engine's start-up), at most train.step_timeout_s.
STEP_FACTOR = 5.0
STEP_FLOOR_S = 120.0
STEP_WINDOW = 20


def step_limit(recent_s: list[float], ceiling_s: float) -> float | None:
    """How long a learner step may run before it counts as a hang; None: no limit (ceiling 0)."""
    if ceiling_s <= 0:
        return None
    if not recent_s:
        return ceiling_s
    return min(ceiling_s, max(STEP_FLOOR_S, STEP_FACTOR * max(recent_s)))


class PromptsExhausted(Exception):
    """The prompt stream ended (data.epochs done, or a finite task) and no full batch can be made
    any more: the run ends after its last complete step."""


class ScaleEvent(msgspec.Struct, frozen=True):
    """One change of the pool (or a decision not to), as logged to RUN_DIR/scaling.jsonl."""

    step: int
    source: str  # 'operator', 'autoscale', 'recovery'
    engines_before: int
    engines_after: int
    reason: str
    at: float = 0.0  # wall-clock time (time.time()) the event was logged: detection delays are measured from it


def latest_checkpoint(run_dir: Path, stream: TextIO | None = None) -> str | None:
    """The newest intact checkpoint (what `--resume` would pick; damaged ones on the way are set aside,
    in one line each on `stream`), or None."""
    found = checkpoint.pick(run_dir, "[recovery]", stream)
    return str(found) if found is not None else None


def learner_hung(ranks: list[int], step: int, limit_s: float) -> str:
    """One line: which ranks did not finish step `step` in time (for LearnerRecovery.decide)."""
    return (
        f"learner rank(s) {', '.join(map(str, ranks))} hung: step {step + 1} still running after {limit_s:.0f}s "
        f"(5x the slowest recent step, at least {STEP_FLOOR_S:.0f}s, at most train.step_timeout_s)"
    )


def learner_died(rank: int, exc: BaseException) -> str:
    """One line: which rank died and the first line of why (for LearnerRecovery.decide)."""
    return f"learner rank {rank} died ({first_line(exc, limit=500)})"


class LearnerRestarted(Exception):
    """The learner group was restarted from a checkpoint (or the initial weights): the training loop
    goes on from `step`, the policy version the restored learner and every engine now hold."""

    def __init__(self, step: int, recoveries: int) -> None:
        super().__init__(f"learner restarted at step {step} (recovery {recoveries})")
        self.step = step
        self.recoveries = recoveries


class Supervisor:
    """Detects dead processes and recovers them through the Runtime; resizes the pool between steps."""

    def __init__(self, rt: Runtime, cfg: Config, run_dir: Path, run_id: str, stream: TextIO,
                 starts: StartRetry | None = None) -> None:
        """`starts`: the engines' start retries the run began with (their failures count in
        failed_starts); None: a fresh count."""
        self.rt = rt
        self.cfg = cfg
        self.run_dir = run_dir
        self.stream = stream
        self.target = cfg.generators.num_engines
        g = cfg.generators
        self.starts = starts if starts is not None else engine_starts(cfg)
        # a reward model's or teacher's replicas: a failed start comes back as a RunError (RewardModelPool)
        self.served_starts = StartRetry(
            g.start_attempts, g.start_backoff_s, (RunError, ray.exceptions.RayError, TimeoutError)
        )
        # a dead engine's replacement starts in the background while the survivors generate; colocated
        # engines share the learner's GPUs, so theirs start while the loop waits (see replace)
        self.refills = Refills(self.starts, self._say)
        self.background_starts = cfg.placement != "colocated"
        self.inbox = ControlInbox(run_dir, run_id)
        self.signals: list[ScaleSignal] = []
        self.steps_since_change = 0
        self._log = open(run_dir / "scaling.jsonl", "ab")
        self._log_lock = threading.Lock()  # the watcher thread logs deaths too
        self.events: list[ScaleEvent] = []
        # A sync was skipped (during a step), so a replaced engine may hold no weights yet: the
        # controller syncs after the step even when train.sync_every would not.
        self.sync_owed = False
        self.step = 0  # the step the loop is at (what the watcher thread's events name)
        self.deaths = DeathWatch(self._targets, self._noticed, cfg.generators.unresponsive_s)
        self._found: list[DeathNotice] = []  # notices taken by a failed sync, for act_on_deaths
        self._step_times: list[float] = []  # the last STEP_WINDOW steps' seconds (the step time limit)
        # A restarting group's fresh ranks answer no probe while their actors are constructed (seconds
        # on a busy machine): watched for death then, not probed (see _targets).
        self._learner_starting = False
        t = cfg.train
        self.recovery = LearnerRecovery(t.recover, t.max_recoveries, t.recovery_window_steps)
        self.failures = FailureWatch(cfg.task.failure_window, reward_name(cfg.task.name, cfg.task.reward), cfg.env.name)

    def start(self) -> None:
        """Start watching every process (see death_watch.py)."""
        self.deaths.start()

    def close(self) -> None:
        self.deaths.stop()
        self.inbox.close()
        self._log.close()

    def _event(self, step: int, source: str, before: int, after: int, reason: str) -> None:
        event = ScaleEvent(step, source, before, after, reason, at=time.time())
        with self._log_lock:
            self.events.append(event)
            if not self._log.closed:
                self._log.write(msgspec.json.encode(event) + b"\n")
                self._log.flush()
            print(f"[{source}] step {step + 1}: {reason}", file=self.stream, flush=True)

    # ---- the learner's step, watched ------------------------------------------------------------

    def train_step(self, step: int) -> list[StepMetrics]:
        """Run step `step` on every rank. While it runs, a death is acted on as soon as it is known:
        a rank's step call fails, or the watcher (death_watch.py) reported a death, which is looked
        for every WAKE_S. Every `generators.health_check_s` the full check runs besides (a hung
        process, failing rewards, the prompt stream). The batch counts as trained once every rank
        returned."""
        self.step = step
        t0 = time.monotonic()
        limit = step_limit(self._step_times, self.cfg.train.step_timeout_s)
        refs = self.rt.start_train_step(step)
        running = {ref: rank for rank, ref in enumerate(refs)}
        every = self.cfg.generators.health_check_s
        next_check = time.monotonic() + every
        while running:
            if limit is not None and time.monotonic() - t0 > limit:
                self.recover_learner(step, learner_hung(sorted(running.values()), step, limit))
            self.act_on_deaths(step, step, during_step=True)
            timeout = min(WAKE_S, max(0.0, next_check - time.monotonic()))
            done, _ = ray.wait(list(running), num_returns=1, timeout=timeout)
            for ref in done:
                rank = running.pop(ref)
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayError as exc:
                    self._rank_call_failed(step, rank, exc)
            if running and time.monotonic() >= next_check:
                self.full_check(step)
                next_check = time.monotonic() + every
        metrics = ray.get(refs)
        self._step_times = [*self._step_times[-(STEP_WINDOW - 1) :], time.monotonic() - t0]
        self.on_buffer(step, lambda: self.rt.ack_batch(step))
        return metrics

    # ---- death notices ----------------------------------------------------------------------------

    def _targets(self) -> dict[Watched, Target]:
        """Every process of the run now, by actor instance (read by the watcher thread: snapshots of
        the handle maps; a map changed while read raises RuntimeError and is read again). Engines and
        replicas still starting are watched but not probed."""
        rt = self.rt
        out = {Watched("buffer", -1, actor_key(rt.buffer)): Target(rt.buffer)}
        for eid, handle in list(rt.generators.engines.items()):
            out[Watched("engine", eid, actor_key(handle.actor))] = Target(handle.actor, handle.started)
        for rank, actor in enumerate(list(rt.learner.actors)):
            out[Watched("learner", rank, actor_key(actor))] = Target(actor, not self._learner_starting)
        for kind, pool in rt.served_pools().items():
            serving = pool.serving()
            for rid, actor in pool.actors().items():
                out[Watched(kind, rid, actor_key(actor))] = Target(actor, rid in serving)
        return out

    def _noticed(self, notice: DeathNotice) -> None:
        """On the watcher thread, the moment a death is known: log it (detection times are measured
        from this event), and abort a weight sync the dead process may be a member of, so no member
        waits for it. The loop acts on the notice itself (act_on_deaths)."""
        name = notice.watched().name()
        n = len(self.rt.generators.engines)
        self._event(self.step, "watch", n, n, f"{name} found dead: {notice.why}")
        # A rank of a learner group already replaced (its restart killed it) is no member of today's group.
        if notice.kind in ("engine", "learner") and self._is_current(notice.watched()):
            member = notice.ident if notice.kind == "engine" else LEARNER
            # on a thread of its own: reaching the group's store can take seconds (it is gone with a
            # dead rank 0), and the watcher must go on watching meanwhile
            args = (member, f"{name} found dead", notice.actor_id if notice.kind == "engine" else None)
            threading.Thread(target=self.rt.generators.abort_sync, args=args, daemon=True).start()

    def _is_current(self, w: Watched) -> bool:
        """The process a notice is about is still in the run (not replaced or removed meanwhile)."""
        rt = self.rt
        if w.kind == "buffer":
            return actor_key(rt.buffer) == w.actor_id
        if w.kind == "engine":
            handle = rt.generators.engines.get(w.ident)
            return handle is not None and actor_key(handle.actor) == w.actor_id
        if w.kind == "learner":
            actors = rt.learner.actors
            return w.ident < len(actors) and actor_key(actors[w.ident]) == w.actor_id
        pool = rt.served_pools().get(w.kind)
        actor = pool.actors().get(w.ident) if pool is not None else None
        return actor is not None and actor_key(actor) == w.actor_id

    def _engines_found_dead(self) -> list[int]:
        """Engines the watcher found dead or hung (a hung one answers no health check either), still
        in the pool; their notices are kept for act_on_deaths, which drops them once replaced."""
        self._found.extend(self.deaths.take())
        return [n.ident for n in self._found if n.kind == "engine" and self._is_current(n.watched())]

    def act_on_deaths(self, step: int, version: int, during_step: bool = False) -> None:
        """Recover every process the watcher found dead since the last look: a dead buffer is
        restarted, dead engines replaced (given the learner's `version`), dead reward-model replicas
        started anew; a dead learner rank restarts the learner group (recover_learner: with
        `train.recover: off`, or past `train.max_recoveries`, it stops the run). A notice about a
        process already replaced (by a failed call's path, an evaluation) is dropped."""
        self.poll_refills(step)
        dead_engines: list[int] = []
        found, self._found = [*self._found, *self.deaths.take()], []
        for notice in found:
            w = notice.watched()
            if not self._is_current(w):
                continue
            if w.kind == "buffer":
                self.restart_buffer(step)
            elif w.kind == "engine":
                dead_engines.append(w.ident)
            elif w.kind == "learner":
                self.recover_learner(step, learner_died(w.ident, RuntimeError(notice.why)))
            else:
                self.recover_served(step, w.kind)
        if dead_engines:
            self.replace(step, dead_engines)
            self.sync(version, during_step=during_step)

    def on_learner(self, step: int, refs: list[ray.ObjectRef]) -> list:
        """The results of a call made on every learner rank outside a step (a checkpoint's save, the
        mismatch probe), in rank order. The ranks meet in collectives there, so the survivors of a
        dead or hung rank would wait for ever: a rank whose call fails, or that the watcher found dead,
        is recovered at once (recover_learner), looked for every WAKE_S."""
        pending = list(refs)
        while pending:
            self.recover_found_learner(step)
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=WAKE_S)
            for ref in done:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayError as exc:
                    self._rank_call_failed(step, refs.index(ref), exc)
        return ray.get(refs)

    def _rank_call_failed(self, step: int, rank: int, exc: ray.exceptions.RayError) -> None:
        """Rank `rank`'s call failed. Its actor died: recover. It raised: when another rank died
        under it (a collective broken by a dead peer: gloo's "Connection reset by peer" often comes
        before Ray reports the peer dead) that death is recovered; otherwise the error is the run's."""
        if isinstance(exc, ray.exceptions.RayActorError):
            self.recover_learner(step, learner_died(rank, exc))
        self._recover_dead_learner(step, RuntimeError(f"its actor died; rank {rank}'s call failed with it"))
        raise exc

    def _recover_dead_learner(self, step: int, why: BaseException) -> None:
        """After a failed call: recover the learner group (recover_learner, which raises) if the watcher
        found one of its ranks dead or hung (a hung rank answers nothing), or a rank's actor is dead
        now (`why`: what its death is reported with). Returns when every rank is alive."""
        self.recover_found_learner(step)
        dead = self.rt.dead_learner_rank()
        if dead is not None:
            self.recover_learner(step, learner_died(dead, why))

    def recover_found_learner(self, step: int) -> None:
        """Recover the learner group (recover_learner, which raises) if the watcher found one of its
        current ranks dead or hung; other notices stay kept for act_on_deaths."""
        self._found.extend(self.deaths.take())
        for n in self._found:
            if n.kind == "learner" and self._is_current(n.watched()):
                self.recover_learner(step, learner_died(n.ident, RuntimeError(n.why)))

    def recover_learner(self, step: int, what: str) -> NoReturn:
        """A learner rank died or hung during step `step` (`what`: one line saying so). The recovery
        policy (recovery.py) decides: the run stops with one line (RunError), or every rank of the group
        is replaced by a fresh actor restored from the newest checkpoint (the initial weights without
        one), the engines get those weights, and LearnerRestarted tells the loop where to go on."""
        ckpt = latest_checkpoint(self.run_dir, self.stream)
        ckpt_step = checkpoint.load_state(Path(ckpt)).step if ckpt is not None else None
        plan = self.recovery.decide(step, what, ckpt, ckpt_step)
        if isinstance(plan, RunError):
            raise plan
        n = len(self.rt.generators.engines)
        origin = ckpt if ckpt is not None else "the initial weights"
        self._event(step, "recovery", n, n, f"{what}; restarting the learner group from {origin} "
                    f"(step {plan.step}, recovery {plan.recoveries})")
        t0 = time.perf_counter()
        while (failure := self._restart_learner(plan)) is not None:
            # A second fault: a rank of the new group died (or hung) while it started. Another recovery,
            # counted against train.max_recoveries like the first; the group starts again from the same place.
            what = f"a rank of the restarting learner group failed ({failure})"
            plan = self.recovery.decide(step, what, ckpt, ckpt_step)
            if isinstance(plan, RunError):
                raise plan
            self._event(step, "recovery", n, n, f"{what}; restarting the learner group again from {origin} "
                        f"(step {plan.step}, recovery {plan.recoveries})")
        # the old group is gone: a checkpoint it was writing stays a `.tmp-` folder, never restored
        checkpoint.discard_partial(self.run_dir, "[recovery] learner group restarted", self.stream)
        self._step_times = []  # the new group's steps set the hang limit afresh
        self.sync(plan.step)  # the engines serve the restored weights, the buffer learns their version
        print(f"[recovery] learner group back at step {plan.step} in {time.perf_counter() - t0:.1f}s",
              file=self.stream, flush=True)
        if (lost := step - plan.step) > 0:  # said where a user reads, not only in scaling.jsonl
            bound = "" if ckpt else "; no checkpoint yet: train.checkpoint_every bounds this"
            print(f"[recovery] the learning of {lost} step(s) was lost with the group and is trained again from "
                  f"step {plan.step}{bound}", file=self.stream, flush=True)
        raise LearnerRestarted(plan.step, plan.recoveries)

    def _restart_learner(self, plan: RestartPlan) -> str | None:
        """Restart the learner group as `plan` says. None: it is up; else one line saying how a rank of the
        new group died or did not answer while it started (the caller decides whether to try again)."""
        self._learner_starting = True
        try:
            self.rt.restart_learner(plan.checkpoint, plan.step)
            return None
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            return first_line(exc, limit=300)
        finally:
            self._learner_starting = False

    # ---- checks ------------------------------------------------------------------------------------

    def full_check(self, step: int) -> None:
        """What the loop checks every `generators.health_check_s` while it waits (a step, a settle):
        dead or hung processes recovered, failing rewards and an ended prompt stream stop the run."""
        self.recover(step)
        stats = self.on_buffer(step, self.rt.buffer_stats)
        self.check_failures(stats)
        self.check_prompts(step, stats)

    def check_failures(self, stats: BufferStats) -> None:
        """Stop a run whose rewards (or requests, or episodes) all fail (failure_watch.py), or whose
        buffer cannot write its snapshot (a full disk: the line names the bytes and the checkpoint)."""
        if stats.storage_error:
            raise RunError(f"{stats.storage_error}; {checkpoint.after_full_disk(self.run_dir)}")
        self._stop_if(self.failures.check(stats), stats.rejected_frames)

    def check_eval(self, record: EvalRecord) -> None:
        """Stop a run whose evaluation's rewards (or prompts) all failed."""
        self._stop_if(self.failures.check_eval(record))

    def _stop_if(self, failing: Failing | None, rejected_frames: dict[str, int] | None = None) -> None:
        """Stop the run with `failing`'s line and the last error an engine recorded; where none did, the
        frames the buffer rejected by reason (a rejected frame's leased samples are counted lost too)."""
        if failing is None:
            return
        last = "none recorded"
        for engine in self.rt.generators.stats():
            error = engine.reward_last_error if failing.source == "reward" else engine.last_error
            if error:
                last = " ".join(error.split())
                break
        else:
            if failing.source == "request" and rejected_frames:
                counts = ", ".join(f"{reason} {n}" for reason, n in sorted(rejected_frames.items()))
                last = f"none recorded by an engine; frames the buffer rejected: {counts}"
        raise RunError(f"{failing.message}; last error: {last}")

    def check_prompts(self, step: int, stats: BufferStats) -> None:
        """No prompt left, none in flight, too few groups waiting: this step's batch never fills."""
        if (
            stats.prompts_exhausted
            and stats.accounts.in_flight == 0
            and stats.waiting_groups < self.cfg.train.prompts_per_step
        ):
            pos = stats.data_position
            raise PromptsExhausted(
                f"the prompt stream ended at epoch {pos.epoch}, index {pos.index} (data.epochs="
                f"{self.cfg.data.epochs}): step {step + 1} cannot be filled; stopping after step {step}"
            )

    def recover(self, step: int) -> None:
        """Restart a dead buffer and dead reward-model replicas; replace dead engines (they get the
        learner's version `step` at once)."""
        if not self.rt.buffer_alive():
            self.restart_buffer(step)
        for kind in self.rt.served_pools():
            self.recover_served(step, kind)
        dead = self.rt.generators.find_dead()
        if not dead:
            return
        self.replace(step, dead)
        self.sync(step, during_step=True)

    def recover_served(self, step: int, kind: str) -> None:
        """A replica served beside the pool that died (its actor, or its vLLM engine core) is started
        anew and every engine calls it at its new address: a reward model's (`reward_model`, calls made
        to it meanwhile failed, counted as reward-model failures) or the teacher's (`teacher`, the
        engines' groups waiting for a score try again, up to teacher.max_wait_s)."""
        pool = self.rt.served_pools().get(kind)
        if pool is None:
            return
        dead = pool.find_dead()
        if not dead:
            return
        n = len(self.rt.generators.engines)
        self._event(step, "recovery", n, n, f"{pool.name} replica(s) {dead} died; restarting them")
        try:
            self.served_starts.run(lambda: pool.restart(dead), f"{pool.name} replica(s) {dead}", self._say)
        except StartsSpent as spent:  # nothing scores the samples: the run stops, its checkpoint named
            raise RunError(f"{spent}; {self._resume_from()}") from None
        self.rt.served_replicas_moved(kind)

    def replace_dead(self, version: int, dead: list[int]) -> dict[int, ActorHandle]:
        """Engines that died outside a training step (an evaluation) are replaced, and every engine
        gets the learner's `version`. Returns the pool's engines by id."""
        dead = [eid for eid in dead if eid in self.rt.generators.engines]
        if dead:
            self.replace(version - 1, dead)
            self.sync(version)
        return {eid: h.actor for eid, h in self.rt.generators.engines.items()}

    def replace(self, step: int, dead: list[int]) -> None:
        """Dead engines leave the pool and replacements start. With survivors they start in the
        background (Refills; poll_refills lets them join); with none left, the run waits until one
        joined (says so once). Colocated: the start is waited for, as for an added engine."""
        pool = self.rt.generators
        before = len(pool.engines)
        for engine_id in dead:
            back = pool.drop_dead(engine_id)
            if back is None:  # the buffer died too: its restart from the snapshot requeues the leases
                self._event(step, "recovery", before, before - 1, f"engine {engine_id} died; the buffer is down too")
                self.restart_buffer(step)
            else:
                self._event(step, "recovery", before, before - 1, f"engine {engine_id} died; {back} leased prompts requeued")
            before -= 1
        missing = self.target - len(pool.engines) - len(self.refills)
        if missing > 0 and self.background_starts:
            new = self.refills.launch(pool, missing, f"engine(s) replacing {dead}")
            meanwhile = f"; meanwhile the run goes on with {before} engine(s)" if before else ""
            self._event(step, "recovery", before, before, f"starting engine(s) {new} in its place{meanwhile}")
        elif missing > 0:
            self._wait_line(step, missing)
            try:
                new = self.start_engines(step, missing, f"engine(s) replacing {dead}")
            except StartsSpent as spent:
                if not pool.engines:  # nothing left to generate with: the run stops, its checkpoint named
                    raise RunError(f"{spent}; {self._resume_from()}") from None
                self.target = len(pool.engines)
                self._event(step, "recovery", before, before, f"{spent}; going on with {before} engine(s)")
                return
            self._event(step, "recovery", before, len(pool.engines), f"started engine(s) {new} in its place")
        if not pool.engines and self.refills:
            self._wait_line(step, len(self.refills))
            self._poll_refills_until(step, lambda: bool(pool.engines))

    def _poll_refills_until(self, step: int, done: Callable[[], bool]) -> None:
        """Look at the background starts every WAKE_S until `done()`; poll_refills raises when every
        start is spent with no engine left, so this never waits on nothing."""
        while not done():
            self.poll_refills(step)
            if not done():
                time.sleep(WAKE_S)

    def _wait_line(self, step: int, count: int) -> None:
        """With no engine left the run waits for its replacements: said once, not once a try."""
        if not self.rt.generators.engines:
            self._say(f"step {step + 1}: no engine is left to generate with; the run waits for {count} "
                      f"replacement(s) to start (up to {self.starts.attempts} start(s) each)")

    def _say(self, line: str) -> None:
        print(f"[recovery] {line}", file=self.stream, flush=True)

    def poll_refills(self, step: int) -> None:
        """Replacements starting in the background that started join the pool (paused: the sync after
        this step gives them the weights); those whose starts are all spent are given up, and the run
        goes on with the engines it has, or with none stops in one line naming its checkpoint."""
        pool = self.rt.generators
        polled = self.refills.poll(pool)
        n = len(pool.engines) - len(polled.joined)  # before these joined (they joined together)
        for engine_id, what in polled.joined:
            self._event(step, "recovery", n, n + 1, f"started engine {engine_id} ({what}); it generates after the next sync")
            n += 1
            self.sync_owed = True
        for spent in polled.spent:
            n = len(pool.engines)
            if not pool.engines and not self.refills:
                raise RunError(f"{spent}; {self._resume_from()}") from None
            self.target -= 1
            self._event(step, "recovery", n, n, f"{spent}; going on with {n} engine(s)")

    def finish_refills(self, step: int, version: int) -> None:
        """The run's end: replacements still starting are waited for, and given the last weights,
        so the run ends with the pool it asked for."""
        if not self.refills:
            return
        self._say(f"step {step + 1}: waiting for {len(self.refills)} replacement engine(s) to start before the run ends")
        self._poll_refills_until(step, lambda: not self.refills)
        self.sync(version)

    def _resume_from(self) -> str:
        """The end of a stop line: the checkpoint to resume from."""
        found = checkpoint.completed(self.run_dir)
        return f"resume from checkpoint {found[-1]}" if found else "no checkpoint was written"

    def restart_buffer(self, step: int) -> None:
        n = len(self.rt.generators.engines)
        # logged when the death is noticed (detection delays are measured from it), then acted on
        self._event(step, "recovery", n, n, f"buffer died; restarting it from {self.run_dir / SNAPSHOT_NAME}")
        t0 = time.perf_counter()
        self.rt.restart_buffer()
        print(f"[recovery] buffer back in {time.perf_counter() - t0:.1f}s", file=self.stream, flush=True)

    # ---- weight sync with recovery --------------------------------------------------------------

    def sync(self, version: int, during_step: bool = False) -> float:
        """Learner weights of `version` into every engine; dead engines are replaced and the sync
        retried. Returns the seconds it took. `during_step`: a train step is running (recovery)."""
        t0 = time.perf_counter()
        for attempt in range(1, SYNC_ATTEMPTS + 1):
            try:
                if not self.rt.sync_weights(version, during_step):
                    self.sync_owed = True  # the learner moved on, or is sharded and mid-step
                    return 0.0
                self.sync_owed = False
                break
            except (RunError, ray.exceptions.RayError, TimeoutError) as exc:
                if NEEDS_FULL_UPDATE in str(exc) and attempt < SYNC_ATTEMPTS:
                    # weight_sync.delta: a receiver refused a delta from a version it does not hold;
                    # the retry forms a new membership, whose first update is full for every engine.
                    self.rt.generators.fell_back(f"weight sync v{version}: {str(exc).strip().splitlines()[-1]}")
                    continue
                grace = SYNC_DEATH_GRACE_S if attempt < SYNC_ATTEMPTS else 0.0
                dead = self._dead_after_failed_sync(version - 1, exc, grace)
                if not dead or attempt == SYNC_ATTEMPTS:
                    if isinstance(exc, RunError):
                        raise
                    raise RunError(f"weight sync v{version} failed: {str(exc).strip().splitlines()[-1]}") from None
                self.replace(version - 1, dead)
        self.on_buffer(version - 1, self.rt.tell_buffer_version)
        return time.perf_counter() - t0

    def settle_generation(self, step: int, version: int) -> float:
        """train.deterministic, before the engines move to `version`: wait until they generated every
        prompt admitted at the version they hold (ReplayBuffer.generation_settled), so each step's
        batch comes from one policy version however the timing fell. Deaths are acted on meanwhile
        and the full check runs every `generators.health_check_s`, as in a step. A dead engine's
        replacement waits, paused, for the next sync (the learner no longer holds the engines'
        version to give it), and the surviving engines generate its prompts again with that version:
        the run still repeats. With no engine left serving that version, the replacement gets
        `version` and the run goes on, no longer repeating (one line says so). Returns the seconds
        it waited."""
        t0 = time.perf_counter()
        held = self.rt.generators_version
        every = self.cfg.generators.health_check_s
        next_check = time.monotonic() + every
        while not self.on_buffer(step, lambda: self.rt.generation_settled(WAKE_S)):
            self.act_on_deaths(step, held)
            if self.sync_owed and not any(e.version == held and not e.paused for e in self.rt.generators.stats()):
                n = len(self.rt.generators.engines)
                self._event(step, "deterministic", n, n, (
                    f"no engine serves version {held} any more: the prompts of a dead engine are generated with "
                    f"version {version}, and from here on the run no longer repeats an unbroken one"))
                self.sync(version)
                break
            if time.monotonic() >= next_check:
                self.full_check(step)
                next_check = time.monotonic() + every
        return time.perf_counter() - t0

    def _dead_after_failed_sync(self, step: int, why: BaseException, grace_s: float) -> list[int]:
        """After a failed sync: recover a dead learner (which raises), else the engines that are dead.
        With none found yet, look again for up to `grace_s` (SYNC_DEATH_GRACE_S)."""
        deadline = time.monotonic() + grace_s
        while True:
            self._recover_dead_learner(step, why)
            # An engine the watcher abandoned is dead or hung even when it has not failed a health
            # check yet (a slow reply under load is not death): count it dead too.
            found = set(self._engines_found_dead()) | set(self.rt.generators.abandoned_engines())
            dead = sorted(set(self.rt.generators.find_dead()) | found)
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(WAKE_S)

    def on_buffer(self, step: int, call: Callable[[], T]) -> T:
        """A Runtime call to the buffer; a dead buffer is restarted from its snapshot and asked again."""
        try:
            return call()
        except ray.exceptions.RayActorError:
            self.restart_buffer(step)
            return call()

    # ---- pool size between steps ----------------------------------------------------------------

    def between_steps(self, step: int, signal: ScaleSignal) -> None:
        """Operator requests first (they win), then the autoscaler."""
        self.steps_since_change += 1
        self.signals = [*self.signals[-99:], signal]  # the policy looks at a short window
        for item in self.inbox.poll():
            if isinstance(item, ScaleReply):  # a malformed request, already answered
                print(f"[operator] {item.message}", file=self.stream, flush=True)
                continue
            self._operator(step, item)
        policy = self.cfg.generators.autoscale
        if policy.enabled:
            current = len(self.rt.generators.engines)
            decision: ScaleDecision = decide(policy, self.signals, current, self.steps_since_change)
            if decision.changes(current):
                try:
                    self.resize(step, "autoscale", decision.engines, decision.reason)
                except (RunError, ray.exceptions.RayError) as exc:  # e.g. no room: try again after cooldown
                    self.steps_since_change = 0
                    after = len(self.rt.generators.engines)
                    self._event(step, "autoscale", current, after, f"{decision.reason}: failed: {exc}")

    def _operator(self, step: int, req: ScaleRequest) -> None:
        before = len(self.rt.generators.engines)
        try:
            if req.engines < 1:
                raise RunError(f"engines must be at least 1, not {req.engines}")
            self.resize(step, "operator", req.engines, f"operator asked for {req.engines} engine(s)")
        except (RunError, ray.exceptions.RayError) as exc:  # a refused request never stops the run
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            now = len(self.rt.generators.engines)
            self.inbox.answer(ScaleReply(req.request_id, False, before, now, message))
            self._event(step, "operator", before, now, f"request for {req.engines} engine(s) failed: {message}")
            return
        after = len(self.rt.generators.engines)
        self.inbox.answer(ScaleReply(req.request_id, True, before, after, f"applied after step {step + 1}"))

    def add_engines(self, count: int) -> list[int]:
        """New engines start paused and receive the current weights at the next sync."""
        new = self.start_engines(self.step, count, f"{count} added engine(s)")
        self.target = len(self.rt.generators.engines)
        return new

    @property
    def failed_starts(self) -> int:
        """Starts that failed over the run: engines', and the reward model's or teacher's replicas'."""
        return self.starts.failed + self.served_starts.failed

    def start_engines(self, step: int, count: int, what: str) -> list[int]:
        """`count` new engines, started again with backoff when their start fails (generators.start_attempts);
        StartsSpent when every start failed."""
        return self.starts.run(lambda: self.rt.generators.add(count, paused=True), what, self._say)

    def remove_engine(self, engine_id: int) -> int:
        """Drain and stop one engine; returns how many of its leases went back to the prompt pool."""
        back = self.rt.generators.remove(engine_id, self.cfg.generators.drain_timeout_s)
        self.target = len(self.rt.generators.engines)
        return back

    def resize(self, step: int, source: str, engines: int, reason: str) -> None:
        pool, cfg = self.rt.generators, self.cfg
        self.refills.cancel(pool)  # the pool's new size is counted from the engines it has
        before = len(pool.engines)
        if engines > before:
            need = (engines - before) * cfg.generators.cpus_per_engine
            free = ray.available_resources().get("CPU", 0.0)
            if free < need:  # refuse now rather than wait for a placement that cannot happen
                raise RunError(f"{engines - before} more engine(s) need {need} CPU(s), the Ray cluster has {free:g} free")
            new = self.start_engines(step, engines - before, f"{engines - before} added engine(s)")
            self.sync(step + 1)  # added engines generate only with the current weights
            detail = f"added engine(s) {new}"
        elif engines < before:
            leaving = sorted(pool.engines)[engines - before :]  # the newest go first
            back = sum(pool.remove(eid, cfg.generators.drain_timeout_s) for eid in leaving)
            detail = f"drained and removed engine(s) {leaving}; {back} unfinished leases requeued"
        else:
            detail = "no change"
        self.target = engines  # only once it happened: a failed resize leaves the target as it was
        if engines != before:
            self.steps_since_change = 0
        self._event(step, source, before, len(pool.engines), f"{reason}: {detail}")
