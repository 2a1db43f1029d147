"""Rotary angles by position id for megatron's GPTModel, for the varlen row (`attention.packed_row`).

Megatron's RoPE without Transformer Engine rotates the tokens of the sequence dimension by positions
0..S-1. For a packed micro-batch flattened to one row that is exact (RoPE is relative, and no token
attends across a sequence's boundary), but not for shared prompts (`learner.share_prompt`): a suffix
sits in the row after its block's other suffixes, while its positions continue its prefix, so its
distance to the prefix would come out too long. `PositionedRotary` takes the place of GPTModel's rotary
module; inside `at(positions)` each token of the row gets the angle of its own position id, gathered
on the device from megatron's own table of every position the model takes (no host read). Outside it,
megatron's module runs as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class PositionedRotary(torch.nn.Module):
    """GPTModel's `rotary_pos_emb` (megatron's `RotaryEmbedding`, kept as `inner`), giving token i of
    a one-row forward the angles of `positions[i]` inside `at`."""

    def __init__(self, inner: torch.nn.Module, table_len: int) -> None:
        super().__init__()
        self.inner = inner
        self.table_len = table_len  # the model's max_position_embeddings: every position id is below it
        self._positions: torch.Tensor | None = None

    @contextlib.contextmanager
    def at(self, positions: torch.Tensor) -> Iterator[None]:
        """Forwards in the block rotate the row's token i by `positions[i]` (long [tokens], on the
        model's device)."""
        self._positions = positions
        try:
            yield
        finally:
            self._positions = None

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None) -> torch.Tensor:
        if self._positions is None:
            return self.inner(max_seq_len, offset=offset, packed_seq=packed_seq, cp_group=cp_group)
        # [table_len, 1, 1, dim] (cached by megatron per length) -> [tokens, 1, 1, dim]
        return self.inner(self.table_len).index_select(0, self._positions)


def install(gpt: Any, table_len: int) -> PositionedRotary:
    """Puts a `PositionedRotary` in `gpt`'s rotary module's place (once) and returns it."""
    if not isinstance(gpt.rotary_pos_emb, PositionedRotary):
        gpt.rotary_pos_emb = PositionedRotary(gpt.rotary_pos_emb, table_len)
    return gpt.rotary_pos_emb
