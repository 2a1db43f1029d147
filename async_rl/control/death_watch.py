"""A watcher thread that keeps one `watch` call pending on every process of the run, all the time.

Ray fails such a call the moment its actor dies; an engine's (or a judge replica's) also returns when
its vLLM engine core exited, or its reward pool is stuck. The thread waits on all of them together,
whatever the training loop is doing (a step, a weight sync, an evaluation, a checkpoint, the gaps
between them), and reports each death once, at once, through `on_death`, which runs on this thread.
The loop acts on the notices (`take`) at its next safe point; what must not wait for that point
(a weight sync blocked on a dead member) is interrupted from `on_death`.

A process that hangs without dying (SIGSTOP, an event loop blocked) keeps its watch pending forever,
so each process also gets a liveness probe (Ray's built-in `__ray_ready__`, which an async actor runs
on its event loop) about every PROBE_EVERY_S; one left unanswered for `unresponsive_s` is reported
as dead too.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import ray
from ray.actor import ActorHandle

WAIT_S = 0.5  # how long one wait lasts before the set of processes is read again (new, replaced, gone)
PROBE_EVERY_S = 1.0  # a liveness probe per process about this often


class Watched(NamedTuple):
    """One process the run watches, by actor instance: a replaced process is a new Watched."""

    kind: str  # 'buffer' | 'engine' | 'learner' | 'reward_model' | 'teacher'
    ident: int  # engine id, learner rank, replica id (-1 for the buffer)
    actor_id: str  # the actor instance's id (hex)

    def name(self) -> str:
        return "buffer" if self.kind == "buffer" else f"{self.kind.replace('_', ' ')} {self.ident}"


class Target(NamedTuple):
    """A process to watch: its handle, and whether to probe it (not while it starts: vLLM's start
    can hold an engine's event loop for minutes on a GPU)."""

    actor: ActorHandle
    probe: bool = True


class DeathNotice(msgspec.Struct, frozen=True):
    """A process found dead, and why, at wall-clock time `at`."""

    kind: str
    ident: int
    actor_id: str
    why: str
    at: float

    def watched(self) -> Watched:
        return Watched(self.kind, self.ident, self.actor_id)


class DeathWatch:
    """`targets()` names every process to watch now (read on this thread, so it must be cheap and
    safe beside the loop: a snapshot of the handles); each gets one pending `watch.remote()`, and
    those to probe a liveness probe."""

    def __init__(
        self,
        targets: Callable[[], dict[Watched, Target]],
        on_death: Callable[[DeathNotice], None],
        unresponsive_s: float = 0.0,
    ) -> None:
        """`unresponsive_s`: a probe unanswered this long is a death (0: no probes)."""
        self._targets = targets
        self._on_death = on_death
        self._unresponsive_s = unresponsive_s
        self._pending: dict[ray.ObjectRef, Watched] = {}
        self._probes: dict[Watched, tuple[ray.ObjectRef, float]] = {}  # the probe in flight, sent when
        self._answered: dict[Watched, float] = {}  # when its last probe was answered
        self._reported: set[Watched] = set()
        self._notices: queue.SimpleQueue[DeathNotice] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="death-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No notice after this returns (a process shut down on purpose would look dead)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        self._pending.clear()

    def take(self) -> list[DeathNotice]:
        """The notices not taken yet, oldest first."""
        out = []
        while True:
            try:
                out.append(self._notices.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(WAIT_S)
            except Exception as exc:  # never let the watcher die silently: say why, keep watching
                print(f"[watch] error while watching: {type(exc).__name__}: {exc}", flush=True)
                time.sleep(WAIT_S)

    def _read_targets(self) -> dict[Watched, Target]:
        for _ in range(100):
            try:
                return self._targets()
            except RuntimeError:  # the loop changed a handle map while it was read: read it again
                time.sleep(0.01)
        return self._targets()

    def poll(self, timeout_s: float) -> list[DeathNotice]:
        """Arm a watch call for every process not watched yet, wait up to `timeout_s` for any to
        finish, report those. Returns the notices it reported (tests drive it this way)."""
        current = self._read_targets()
        self._pending = {ref: w for ref, w in self._pending.items() if w in current}
        armed = set(self._pending.values())
        for w, target in current.items():
            if w not in armed and w not in self._reported:
                self._pending[target.actor.watch.remote()] = w
        hung = self._probe(current)
        if not self._pending:
            self._stop.wait(timeout_s)
            return self._report_hung(hung)
        done, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout_s, fetch_local=False)
        if not done:
            return self._report_hung(hung)
        # A process the loop removed on purpose (drained, replaced, restarted) was taken out of the
        # run before it was stopped: its watch ends, but it is no death.
        still = self._read_targets()
        out = []
        for ref in done:
            w = self._pending.pop(ref)
            if self._stop.is_set():
                break
            if w not in still:
                continue
            notice = DeathNotice(w.kind, w.ident, w.actor_id, _why(ref), time.time())
            self.report(notice)
            out.append(notice)
        return out + self._report_hung([(w, why) for w, why in hung if w not in self._reported])

    def _probe(self, current: dict[Watched, Target]) -> list[tuple[Watched, str]]:
        """Send a probe to every process without one in flight (at most every PROBE_EVERY_S); return
        those whose probe went unanswered for `unresponsive_s`, with why."""
        if self._unresponsive_s <= 0:
            return []
        now = time.monotonic()
        self._probes = {w: p for w, p in self._probes.items() if w in current and current[w].probe}
        self._answered = {w: t for w, t in self._answered.items() if w in current}
        if self._probes:
            done, _ = ray.wait([ref for ref, _ in self._probes.values()], num_returns=len(self._probes), timeout=0)
            answered = set(done)
            for w, (ref, _) in list(self._probes.items()):
                if ref in answered:
                    del self._probes[w]
                    self._answered[w] = now
        hung = []
        for w, target in current.items():
            if w in self._reported or not target.probe:
                continue
            if w in self._probes:
                silent = now - self._probes[w][1]
                if silent >= self._unresponsive_s:
                    hung.append((w, f"no answer to a liveness probe for {silent:.0f}s (stopped, or hung)"))
            elif now - self._answered.get(w, 0.0) >= PROBE_EVERY_S:
                self._probes[w] = (target.actor.__ray_ready__.remote(), now)
        return hung

    def _report_hung(self, hung: list[tuple[Watched, str]]) -> list[DeathNotice]:
        out = []
        for w, why in hung:
            if self._stop.is_set():
                break
            notice = DeathNotice(w.kind, w.ident, w.actor_id, why, time.time())
            self.report(notice)
            out.append(notice)
        return out

    def report(self, notice: DeathNotice) -> None:
        """Queue `notice` for the loop and tell `on_death` (on the calling thread)."""
        self._reported.add(notice.watched())
        self._notices.put(notice)
        self._on_death(notice)


def _why(ref: ray.ObjectRef) -> str:
    try:
        answer = ray.get(ref, timeout=5)
    except ray.exceptions.RayActorError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return "its actor died" + (f" ({first[:160]})" if first else "")
    except ray.exceptions.RayError as exc:
        return f"its watch failed: {type(exc).__name__}"
    return str(answer)
