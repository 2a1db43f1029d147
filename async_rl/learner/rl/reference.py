"""The frozen reference policy for the KL penalty: the initial weights, loaded once, never trained.

It lives on the learner's device (the backend's own), and scores a padded shard in micro-batches of its
rows cut as every pass of the learner is (`batch/cut.py`: by `learner.micro_batch_tokens`, then by the
learner's cost model, on the path of the kernel that scores padded rows: SDPA under their padding mask),
at the loss positions only, with the chunked head (`head.py`): no whole-shard pass, no [tokens x
vocabulary] logits. The head's per-chunk arithmetic runs compiled where the policy's does
(`learner.head_kernel`, `head_fused`).

Under sequence parallelism the ranks of an SP group hold the same shard. The reference pass does not
split a sequence over them (it runs whole sequences); instead each rank scores a share of the shard's
micro-batches (`RowShare`, balanced by padded tokens) and the group sums the results, so the pass
costs each rank 1/SP of the shard, not all of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from async_rl.learner.batch.cut import MicroBatchCut
from async_rl.learner.model import head_fused
from async_rl.learner.model.head import DEFAULT_CHUNK, flat_index, model_scores, unsupported
from async_rl.learner.model.moe import RouterReplay, moe_shape
from async_rl.models.cost import deal, path_of


@dataclass(frozen=True)
class RowShare:
    """The ranks that hold the same shard (an SP group): `size` of them, this one `rank` among them,
    `group` their process group."""

    size: int
    rank: int
    group: Any  # torch.distributed.ProcessGroup

    def mine(self, batches: list[list[int]], lengths: list[int]) -> list[list[int]]:
        """This rank's micro-batches: each, largest first, goes to the rank with the fewest padded
        tokens so far (the same on every rank of the group: the same shard, the same cut)."""
        owner = deal([float(len(b) * max(lengths[r] for r in b)) for b in batches], self.size)
        return [b for b, o in zip(batches, owner, strict=True) if o == self.rank]

    def sum(self, out: torch.Tensor, device: torch.device) -> None:
        """Every rank's scores into `out` (each row was scored by one rank, zeros elsewhere), over the
        device the group's backend takes (NCCL: CUDA tensors)."""
        t = out.to(device)
        dist.all_reduce(t, group=self.group)
        out.copy_(t)


class ReferencePolicy:
    def __init__(
        self,
        model_dir: str,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        cut: MicroBatchCut,
        logprob_chunk_tokens: int = DEFAULT_CHUNK,
        head_kernel: str = "eager",
        routing_replay: bool = False,
        share: RowShare | None = None,
    ) -> None:
        """`share`: the SP group the shard's micro-batches are shared with (None: all are this rank's);
        `cut`: the learner's micro-batch cut, its cost model with it (`batch/cut.py`); `head_kernel`:
        `learner.head_kernel` (auto: compiled on CUDA, eager on the CPU; triton: the forward statistics in
        `head_triton`'s kernel, the reference pass's only use of the head);
        `routing_replay`: an MoE model replays the shard's recorded routes (`learner/model/moe.py`)."""
        from transformers import AutoModelForCausalLM

        # Loaded from the checkpoint the run started from (not copied from the live model): the same
        # weights whatever wrapping (DDP, FSDP) the trained model has, and the same after a resume.
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.cut = cut
        self.chunk = logprob_chunk_tokens if unsupported(self.model) is None else 0
        self.fused = head_fused.fused_setting(head_kernel, self.device.type)
        self._as_reference: Callable[[], AbstractContextManager] = contextlib.nullcontext
        replays = routing_replay and moe_shape(self.model) is not None
        self.router_replay = RouterReplay(self.model) if replays else None
        self.share = share

    @classmethod
    def of_base(
        cls,
        model: torch.nn.Module,
        as_reference: Callable[[], AbstractContextManager],
        *,
        cut: MicroBatchCut,
        logprob_chunk_tokens: int = DEFAULT_CHUNK,
        head_kernel: str = "eager",
        share: RowShare | None = None,
    ) -> ReferencePolicy:
        """The trained model itself, scored inside `as_reference()` (LoRA: the adapter disabled, so the
        frozen base weights are the reference and no second copy of them is loaded)."""
        ref = cls.__new__(cls)
        ref.model, ref.device = model, next(model.parameters()).device
        ref.cut = cut
        ref.chunk = logprob_chunk_tokens if unsupported(model) is None else 0
        ref.fused = head_fused.fused_setting(head_kernel, ref.device.type)
        ref._as_reference = as_reference
        ref.router_replay = None  # LoRA's base: dense models only (MoE with lora is refused)
        ref.share = share
        return ref

    def _routing(self, b, rows: torch.Tensor, width: int):
        """The replay plan of rows `rows` (their first `width` tokens) of the shard, or a null context."""
        if self.router_replay is None:
            return contextlib.nullcontext()
        routes = None if b.routes is None else b.routes[rows, :width].to(self.device)
        return self.router_replay.plan(routes, replay=True)

    def score(self, b, temperature: float) -> torch.Tensor:
        """log p_ref(targets) [B, T] (float32, on the shard's device) of a padded shard (`TokenBatch`:
        input_ids/attention_mask [B, T + 1], loss_mask [B, T]); 0 outside the loss mask."""
        out = torch.zeros(b.loss_mask.shape, dtype=torch.float32, device=b.loss_mask.device)
        lengths = [int(n) for n in b.attention_mask.sum(dim=1).tolist()]
        # HF's SDPA under the rows' padding mask, on every device: the `dense` path (`models/cost.py`)
        batches = self.cut.padded_rows(lengths, path_of("sdpa", self.device.type))
        for rows in batches if self.share is None else self.share.mine(batches, lengths):
            width = max(1, max(lengths[r] for r in rows))
            idx = torch.tensor(rows)
            ids = b.input_ids[idx, :width].to(self.device)
            targets = torch.zeros_like(ids)
            targets[:, :-1] = ids[:, 1:]
            # the loss positions, found on the host (b is a host batch): no sync on the device
            host = torch.zeros(ids.shape, dtype=torch.bool)
            host[:, : width - 1] = b.loss_mask[idx, : width - 1] != 0
            positions = host.to(self.device)
            index = flat_index(host).to(self.device)
            inputs = {"input_ids": ids, "attention_mask": b.attention_mask[idx, :width].to(self.device),
                      "use_cache": False}
            with torch.no_grad(), self._as_reference(), self._routing(b, idx, width):
                logp, _, _ = model_scores(
                    self.model, inputs, targets, index, temperature, self.chunk, entropy=False, fused=self.fused
                )
            logp = logp * positions  # the full head (chunk 0) scores every position
            out[idx, : width - 1] = logp[:, : width - 1].to(out.device)
        if self.share is not None:
            self.share.sum(out, self.device)
        return out
