"""FlexAttention's block mask for a micro-batch, built on the device from its segment table
(`attention.Segments`) by plain tensor ops, and the flex kernel compiled once for every packed length.

`create_block_mask` evaluates the mask rule over every query x key position to find which
128 x 128 tiles are empty, partial or full; on CUDA with `_compile=True` it compiles that evaluation,
and a new packed length means a new compile (the H200 run of 2026-11-26 missed its 90 s limit with
flex). Here the tiles come from intervals instead. Under the rules of `attention.py` a query `q` of
segment `s` reads two key intervals: its own segment up to itself, `[start(s), q]`, and its block's
prefix, `[start(p), end(p))` (none without one). A tile (query block i, key block j) is

- *partial* (the rule is evaluated inside it) when some query of block i meets key block j in one
  of its intervals, and
- *full* (read without the rule) when every query of block i covers key block j with the union of
  its intervals,

which is what `create_block_mask` finds from the same rule (the unit tests compare both). The rule
itself (`mask_mod`) stays for the partial tiles.

Shapes repeat: the flattened micro-batch is padded up to a multiple of the tile size (`BLOCK`) with
one padding segment of its own (it sees only itself; its outputs are dropped), and the flex kernel is
compiled once with dynamic shapes (`compiled_flex`), so different packed lengths reuse one graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

BLOCK = 128  # FlexAttention's default tile (query and key block size)
CHUNK_ENTRIES = 1 << 24  # query x key-block booleans formed at once by `tile_maps`


def padded_length(tokens: int) -> int:
    """`tokens` rounded up to a multiple of the tile size: the length flex runs at."""
    return -(-tokens // BLOCK) * BLOCK


@dataclass
class FlexMask:
    """One micro-batch's block mask and the length its tokens are padded to."""

    tokens: int  # real tokens (rows x width)
    length: int  # padded to a multiple of BLOCK
    block_mask: object  # torch's BlockMask over `length` queries and keys


def padded_segments(lengths: torch.Tensor, prefix: torch.Tensor, tokens: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A segment table (`attention.Segments`: `lengths`, `prefix` of each segment, covering `tokens`
    positions) over the padded length N: (segment of each position [N], prefix of each segment,
    segment starts, lengths), the padding (if any) one more segment without a prefix."""
    length = padded_length(tokens)
    if length > tokens:
        lengths = torch.cat([lengths, lengths.new_full((1,), length - tokens)])
        prefix = torch.cat([prefix, prefix.new_full((1,), -1)])
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths, output_size=length)
    return ids, prefix, torch.cumsum(lengths, 0) - lengths, lengths


def mask_rule(ids: torch.Tensor, prefix: torch.Tensor):
    """The rules as FlexAttention's mask_mod over flattened positions: causal within a segment, and a
    suffix onto its block's prefix."""

    def rule(b, h, q, kv):
        sq, sk = ids[q], ids[kv]
        return (q >= kv) & ((sq == sk) | (prefix[sq] == sk))

    return rule


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [1, 1, nq, nk] tile map as BlockMask tables: the count per query block, and the key blocks
    listed marked ones first in ascending order (as torch orders them)."""
    marked = blocks.to(torch.int32)
    return marked.sum(-1, dtype=torch.int32), torch.argsort(marked, dim=-1, descending=True, stable=True).to(torch.int32)


def tile_maps(ids: torch.Tensor, prefix: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full): bool [nq, nk] tile maps of a padded micro-batch (`padded_segments`), from the
    key intervals of every query (module docstring). No host sync; the query x key-block booleans are
    formed CHUNK_ENTRIES at a time (a 262k-token micro-batch would otherwise hold 0.5 G of them)."""
    n = ids.shape[0]
    nb = n // BLOCK
    device = ids.device
    # each query's intervals, [N]: its own segment from own_start (up to itself), its prefix's
    # [pre_start, pre_end) where it has one (empty otherwise)
    own_start = starts[ids]
    p = prefix[ids]
    has = p >= 0
    pre_start = torch.where(has, starts[p.clamp(min=0)], 0)
    pre_end = torch.where(has, pre_start + lengths[p.clamp(min=0)], 0)
    adjacent = has & (pre_end == own_start)  # the prefix then its first suffix: one interval
    lo = torch.arange(nb, device=device)[None, :] * BLOCK  # first key of each key block [1, nb]
    hi = lo + BLOCK - 1
    step = max(1, CHUNK_ENTRIES // (BLOCK * nb)) * BLOCK  # queries per chunk: whole query blocks
    meets, full = [], []
    for a in range(0, n, step):
        at = slice(a, min(a + step, n))
        t = torch.arange(at.start, at.stop, device=device)[:, None]
        own, h = own_start[at, None], has[at, None]
        ps, pe = pre_start[at, None], pre_end[at, None]
        m = ((lo <= t) & (hi >= own)) | (h & (lo < pe) & (hi >= ps))
        c = ((lo >= own) & (hi <= t)) | (h & (lo >= ps) & (hi < pe)) | (adjacent[at, None] & (lo >= ps) & (hi <= t))
        meets.append(m.view(-1, BLOCK, nb).any(1))
        full.append(c.view(-1, BLOCK, nb).all(1))
    meets_t, full_t = torch.cat(meets), torch.cat(full)
    return meets_t & ~full_t, full_t


def build(lengths: torch.Tensor, prefix: torch.Tensor, tokens: int) -> FlexMask:
    """The micro-batch's BlockMask from its segment table (`padded_segments`), on its device."""
    from torch.nn.attention.flex_attention import BlockMask

    ids, prefix, starts, lengths = padded_segments(lengths, prefix, tokens)
    partial, full = tile_maps(ids, prefix, starts, lengths)
    kv_num, kv_idx = _ordered(partial[None, None])
    full_num, full_idx = _ordered(full[None, None])
    length = ids.shape[0]
    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_rule(ids, prefix), seq_lengths=(length, length))
    return FlexMask(tokens, length, mask)


def compile_flex(backend: str | Callable = "inductor") -> Callable:
    """flex_attention under torch.compile with dynamic shapes (every size symbolic from the first
    call), so a new padded length or a new micro-batch's mask reuses the graph. One exception, at
    most one more compile: flex marks the head count and head size static, and dynamo's duck sizing
    gives equal sizes one symbol, so a first micro-batch whose tile count equals one of them
    specializes the tile count; the recompile for the next length is dynamic. `backend`: the tests
    count compiles through a counting backend."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True, backend=backend)


@lru_cache(maxsize=1)
def compiled_flex() -> Callable:
    """The process's compiled flex kernel (CUDA)."""
    return compile_flex()
