"""Prompt leases: which engine holds which prompt, and admission into them (via the Ledger).

An engine asks for prompts; it gets them only while the ledger admits more samples (bounded
staleness) and while the engine is open. Every lease ends settled (its group arrived), lost (it will
never arrive) or requeued (handed back to the prompt source for another engine).
"""

from __future__ import annotations

import msgspec

from async_rl.buffer.ledger import Ledger
from async_rl.buffer.prompt_source import PromptSource
from async_rl.protocol import Prompt


class Lease(msgspec.Struct, frozen=True):
    engine_id: int
    prompt: Prompt


class Leases:
    def __init__(self, ledger: Ledger, source: PromptSource, group_size: int) -> None:
        self._ledger = ledger
        self._source = source
        self._group_size = group_size
        self._closed: set[int] = set()  # draining or dead engines: no new leases
        self._outstanding: dict[int, tuple[int, Prompt]] = {}  # prompt_id -> (engine_id, prompt)

    def is_closed(self, engine_id: int) -> bool:
        return engine_id in self._closed

    def close(self, engine_id: int) -> None:
        self._closed.add(engine_id)

    def grant(self, engine_id: int, max_groups: int) -> list[Prompt]:
        """Up to `max_groups` prompts for the engine, as many as admission allows now."""
        prompts = self._source.take(min(max_groups, self._ledger.capacity_groups()))
        self._ledger.lease(len(prompts))
        for p in prompts:
            self._outstanding[p.prompt_id] = (engine_id, p)
        return prompts

    def lowest_pending(self) -> int | None:
        """The lowest prompt id leased or handed back and not yet arrived (None: none)."""
        ids = [*self._outstanding, *(p.prompt_id for p in self._source.returned())]
        return min(ids) if ids else None

    def owner(self, prompt_id: int) -> int | None:
        """The engine holding the lease of `prompt_id` (None: not leased)."""
        held = self._outstanding.get(prompt_id)
        return None if held is None else held[0]

    def settle(self, prompt_id: int) -> Prompt:
        """The lease's group arrived: it is no longer outstanding."""
        return self._outstanding.pop(prompt_id)[1]

    def count(self, engine_id: int) -> int:
        return sum(1 for eid, _ in self._outstanding.values() if eid == engine_id)

    def held(self) -> list[Lease]:
        return [Lease(engine_id=eid, prompt=p) for eid, p in self._outstanding.values()]

    def lose(self, engine_id: int, prompt_ids: list[int] | None = None) -> list[int]:
        """The engine's leases (all, or these) will never come back: counted lost. Returns their ids."""
        gone = self._take(engine_id, prompt_ids)
        for _ in gone:
            self._ledger.lost(self._group_size)
        return [p.prompt_id for p in gone]

    def requeue(self, engine_id: int, prompt_ids: list[int] | None = None) -> int:
        """Close the engine and hand its leases (all, or these) back to the prompt source, counted
        `requeued`. Returns how many."""
        self._closed.add(engine_id)
        back = self._take(engine_id, prompt_ids)
        for _ in back:
            self._ledger.requeued_lease(self._group_size)
        self._source.give_back(back)
        return len(back)

    def lose_all(self) -> None:
        """The buffer closes: whatever is still in flight is counted lost."""
        for _ in self._outstanding:
            self._ledger.lost(self._group_size)
        self._outstanding.clear()

    def _take(self, engine_id: int, prompt_ids: list[int] | None) -> list[Prompt]:
        wanted = None if prompt_ids is None else set(prompt_ids)
        gone = [pid for pid, (eid, _) in self._outstanding.items() if eid == engine_id and (wanted is None or pid in wanted)]
        return [self._outstanding.pop(pid)[1] for pid in gone]
