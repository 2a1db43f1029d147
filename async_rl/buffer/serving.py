"""Batch serving: complete groups wait here until a learner rank asks for a step's batch.

The first request for a step builds its batch (FIFO, stale groups dropped); every rank then gets its
shard over the ZMQ ROUTER socket. A built batch is kept (and served again to a rank that asks again)
until the controller acknowledges that the learner trained on it: only then are its samples counted
`trained`. A batch never acknowledged (its learner died) is counted lost when the buffer closes.
The ledger counts episodes (the leased unit): a split agent episode's segments count once, and a
group is stale by its oldest segment.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

import zmq
import zmq.asyncio

from async_rl.buffer.balance import balanced_shards
from async_rl.buffer.ledger import Ledger
from async_rl.models.cost import TOKENS, CostModel
from async_rl.protocol import FrameError, TrajectoryGroup, decode_request, encode_groups


class BatchServer:
    def __init__(
        self,
        run_id: str,
        prompts_per_step: int,
        max_lag: int,
        ledger: Ledger,
        rejected: collections.Counter[str],
        filtered_groups: Callable[[], int],
        changed: asyncio.Condition,
        lowest_pending: Callable[[], int | None] | None = None,
    ) -> None:
        """`lowest_pending`: train.deterministic, the lowest prompt id leased or handed back but not yet
        arrived (None: none); a batch is then the lowest prompt ids, in order (see `_take_in_order`).
        None: batches are built first come, first served."""
        self._run_id = run_id
        self._prompts_per_step = prompts_per_step
        self._max_lag = max_lag
        self._ledger = ledger
        self._rejected = rejected  # the buffer's tally of rejected frames (shared with ingest)
        self._filtered_groups = filtered_groups  # groups dropped by dynamic sampling so far (ingest's count)
        self._changed = changed  # the buffer's condition: notified on every state change
        self._lowest_pending = lowest_pending
        self._waiting: collections.deque[TrajectoryGroup] = collections.deque()
        self._batches: dict[int, list[list[TrajectoryGroup]]] = {}  # step -> per-rank shards, until acked
        self.last_batch = (-1, 0, 0.0)  # (step, max lag, mean lag)
        self._filtered_at_batch = (0, 0)  # (filtered groups at the last batch, the last batch's share)

    # ---- state ---------------------------------------------------------------------------------

    def add(self, g: TrajectoryGroup) -> None:
        """A complete group arrived (its samples are counted `waiting` by the ledger)."""
        self._waiting.append(g)

    @property
    def waiting_groups(self) -> int:
        return len(self._waiting)

    @property
    def last_batch_filtered_groups(self) -> int:
        return self._filtered_at_batch[1]

    def waiting(self) -> list[TrajectoryGroup]:
        return list(self._waiting)

    def built(self) -> dict[int, list[list[TrajectoryGroup]]]:
        """Batches built but not yet acknowledged as trained."""
        return dict(self._batches)

    def ack(self, step: int) -> int:
        """The learner trained on batch `step`: its samples are `trained` now. Returns how many;
        0 for a step already acknowledged (an ack repeated to a restarted buffer)."""
        shards = self._batches.pop(step, None)
        if shards is None:
            return 0
        samples = sum(g.episode_count for shard in shards for g in shard)
        self._ledger.trained(samples)
        return samples

    def lose_unacked(self) -> int:
        """The buffer closes: batches handed out but never acknowledged are counted lost."""
        samples = sum(g.episode_count for shards in self._batches.values() for shard in shards for g in shard)
        self._ledger.lost_waiting(samples)
        self._batches.clear()
        return samples

    def restore(self, waiting: list[TrajectoryGroup], built: dict[int, list[list[TrajectoryGroup]]]) -> None:
        self._waiting.extend(waiting)
        self._batches.update(built)

    # ---- serving -------------------------------------------------------------------------------

    async def build(self, step: int, world_size: int, cost: CostModel = TOKENS) -> list[list[TrajectoryGroup]]:
        """Take `prompts_per_step` fresh groups (FIFO), dropping stale ones; learner version == step.
        The batch is kept, split in per-rank shards balanced by the learner's `cost` (balance.py), until
        it is acknowledged (`ack`); its samples stay counted `waiting` until then."""
        need = self._prompts_per_step
        batch: list[TrajectoryGroup] = []
        changed = self._changed
        async with changed:
            if self._lowest_pending is not None:
                batch = await self._take_in_order(step, need)
            while len(batch) < need:
                while not self._waiting:
                    await changed.wait()
                g = self._waiting.popleft()
                if Ledger.is_stale(g.oldest_version, step, self._max_lag):
                    self._ledger.dropped_stale(g.episode_count)
                    changed.notify_all()  # dropping frees admission capacity
                    continue
                batch.append(g)
            changed.notify_all()
        lags = [step - g.oldest_version for g in batch]
        self.last_batch = (step, max(lags), sum(lags) / len(lags))
        filtered = self._filtered_groups()
        self._filtered_at_batch = (filtered, filtered - self._filtered_at_batch[0])
        shards = self._batches[step] = balanced_shards(batch, world_size, cost)
        return shards

    async def _take_in_order(self, step: int, need: int) -> list[TrajectoryGroup]:
        """train.deterministic (caller holds the condition): the `need` waiting groups of the lowest
        prompt ids, in prompt-id order, once no lower id is still leased or handed back: the same
        batch whichever engine finished first. Prompt ids rise in the order prompts are drawn, so
        these are the step's own prompts. None is stale: the schedule generated each at its version."""
        def ready() -> bool:
            if len(self._waiting) < need:
                return False
            pending = self._lowest_pending()
            return pending is None or sorted(g.prompt_id for g in self._waiting)[need - 1] < pending

        await self._changed.wait_for(ready)
        batch = sorted(self._waiting, key=lambda g: g.prompt_id)[:need]
        taken = {g.prompt_id for g in batch}
        self._waiting = collections.deque(g for g in self._waiting if g.prompt_id not in taken)
        # the schedule was broken (a death, a recovery): stale groups go, as in a free-running step
        for g in [g for g in batch if Ledger.is_stale(g.oldest_version, step, self._max_lag)]:
            self._ledger.dropped_stale(g.episode_count)
            batch.remove(g)
        self._changed.notify_all()
        return batch

    async def run(self, router: zmq.asyncio.Socket, on_built: Callable[[], None]) -> None:
        """The serve loop: answer each rank's request with its shard of the step's batch.
        `on_built` runs right after a batch is built (the batch is then in the snapshot: a restarted
        buffer serves the same batch again)."""
        while True:
            try:
                identity, *parts = await router.recv_multipart()
            except zmq.Again:
                continue  # spurious wake-up, see SPURIOUS_WAKEUP in buffer/actor.py
            try:
                if len(parts) != 1:
                    raise FrameError("bad_request", f"expected 1 part, got {len(parts)}")
                req = decode_request(parts[0], self._run_id)
            except FrameError as exc:
                self._rejected[exc.reason] += 1
                continue
            if req.step not in self._batches:
                cost = CostModel(attention_weight=req.attention_weight, path=req.attention_path, row_tokens=req.row_tokens)
                await self.build(req.step, req.world_size, cost)
                on_built()  # no await since the build: the state it sees is the batch's
            shards = self._batches[req.step]
            frames = encode_groups(self._run_id, shards[req.rank], step=req.step)
            await router.send_multipart([identity, *frames])
