"""How many prompts an engine may lease at a time.

`max_generating` prompts roll out at once (`generators.max_inflight_prompts`: the engine's share of
vLLM's batch). With a teacher (on-policy distillation) a finished group then waits for its teacher
scores before it is pushed. That wait must not hold a generating slot: a slow or restarting teacher
would otherwise fill every slot within one rollout and stop the engine. A waiting group therefore gives
its slot back, and the engine holds at most `max_generating + max_waiting` prompts in all
(`teacher.max_waiting_groups`: a bound on its memory and on how stale the groups grow while the teacher
is away). Only then does it stop leasing, until a score (or `teacher.max_wait_s`) lets a group go.
"""

from __future__ import annotations

import asyncio


class PromptSlots:
    def __init__(self, max_generating: int, max_waiting: int = 0) -> None:
        self.max_generating = max_generating
        self.max_waiting = max_waiting
        self._generating: set[str] = set()
        self._waiting: set[str] = set()
        self._changed = asyncio.Event()

    @property
    def generating(self) -> int:
        return len(self._generating)

    @property
    def waiting(self) -> int:
        """Finished groups waiting for their teacher scores."""
        return len(self._waiting)

    def room(self) -> int:
        """Prompts the engine may lease now."""
        held = self.generating + self.waiting
        return max(0, min(self.max_generating - self.generating, self.max_generating + self.max_waiting - held))

    def start(self, request_id: str) -> None:
        self._generating.add(request_id)

    def rolled_out(self, request_id: str) -> None:
        """The request's group is generated and now waits for its teacher scores: its slot is free."""
        if request_id in self._generating:
            self._generating.discard(request_id)
            self._waiting.add(request_id)
            self._changed.set()

    def finished(self, request_id: str) -> None:
        """The request is pushed, lost or cancelled."""
        self._generating.discard(request_id)
        self._waiting.discard(request_id)
        self._changed.set()

    async def wait_for_room(self) -> None:
        """Returns once a slot may have been freed (the caller asks `room()` again)."""
        if self.room() > 0:
            return
        self._changed.clear()  # no await between the check and here: no wake-up is missed
        await self._changed.wait()
