"""FlexAttention's device-built block mask (learner/model/attention_flex.py) on CPU.

- Its tile tables equal what torch's `create_block_mask` builds from the same rule: packed rows,
  shared-prompt blocks (a prefix read whole by several suffixes), padding, tiles full, partial and
  empty, lengths that are and are not multiples of the tile.
- The mask it stands for, tile by tile, is the dense SDPA mask of the same micro-batch (flattened
  rows; the padding tail sees only itself).
- The flex kernel compiled with dynamic shapes compiles once for five different packed lengths and
  computes what the eager kernel does.

Values through a model (flex == the dense path, fp32) are in test_attention.py. Gradients of the flex
kernel cannot be taken on CPU (torch has no CPU backward for it); with the mask equal element by
element here, the kernel's own gradients are left to tests/gpu/test_attention_cuda.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from async_rl.learner.model import attention_flex
from async_rl.learner.model.attention import Segments, SegmentTable, dense_mask
from async_rl.learner.model.attention_flex import BLOCK, build, padded_segments, tile_maps
from tests.unit.test_attention import layouts


def random_table(seed: int, rows: int, width: int, longest: int) -> Segments:
    """Rows of packed sequences and shared-prompt blocks (a prefix and up to four suffixes), tails
    extended or padded."""
    r = random.Random(seed)
    t = SegmentTable(width)
    for _ in range(rows):
        used = 0
        while used < width - 2:
            n = r.randint(1, longest)
            if used + n > width:
                break
            used += n
            if r.random() < 0.5:
                prefix = t.add(n)
                for _ in range(r.randint(1, 4)):
                    m = r.randint(1, longest)
                    if used + m > width:
                        break
                    t.add(m, prefix)
                    used += m
            else:
                t.add(n)
        t.end_row(r.choice(["extend", "own"]))
    return t.build()


def tables() -> list[Segments]:
    short = [random_table(s, rows=1 + s % 4, width=100 + 37 * s, longest=150) for s in range(8)]
    long = [random_table(s, rows=2, width=1024 + 128 * s, longest=700) for s in range(8, 12)]  # full tiles
    return short + long + [mb.segments for mb in layouts().values()]


FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def test_the_tile_tables_equal_create_block_mask_s():
    full_tiles = shared = 0
    for seg in tables():
        tokens = seg.rows * seg.width
        mask = build(seg.lengths, seg.prefix, tokens)
        assert mask.length % BLOCK == 0 and 0 <= mask.length - tokens < BLOCK
        ids, prefix, _, _ = padded_segments(seg.lengths, seg.prefix, tokens)
        ref = create_block_mask(attention_flex.mask_rule(ids, prefix), 1, None, mask.length, mask.length, device="cpu")
        for field in FIELDS:
            assert torch.equal(getattr(mask.block_mask, field), getattr(ref, field)), field
        assert mask.block_mask.seq_lengths == ref.seq_lengths
        full_tiles += int(ref.full_kv_num_blocks.sum())
        shared += seg.shares_prefixes
    assert full_tiles > 20 and shared > 5  # the tables exercise full tiles and shared prefixes


def test_the_tables_do_not_depend_on_the_chunking(monkeypatch):
    seg = random_table(9, rows=2, width=1500, longest=700)
    tokens = seg.rows * seg.width
    whole = build(seg.lengths, seg.prefix, tokens).block_mask
    monkeypatch.setattr(attention_flex, "CHUNK_ENTRIES", BLOCK)  # one query block per chunk
    chunked = build(seg.lengths, seg.prefix, tokens).block_mask
    for field in FIELDS:
        assert torch.equal(getattr(whole, field), getattr(chunked, field)), field


def test_the_tiles_stand_for_the_dense_mask():
    """full tile -> every entry, partial -> the rule, none -> nothing: element by element the dense
    SDPA mask of the flattened rows (block-diagonal over rows), the padding causal among itself."""
    for seg in tables()[::3]:
        tokens = seg.rows * seg.width
        ids, prefix, starts, lengths = padded_segments(seg.lengths, seg.prefix, tokens)
        partial, full = tile_maps(ids, prefix, starts, lengths)
        n = ids.shape[0]
        q, kv = torch.arange(n)[:, None], torch.arange(n)[None, :]
        rule = attention_flex.mask_rule(ids, prefix)(0, 0, q, kv)

        def entries(tiles: torch.Tensor) -> torch.Tensor:
            return tiles.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)

        implied = entries(full) | (entries(partial) & rule)
        expected = torch.zeros(n, n, dtype=torch.bool)
        rows = dense_mask(seg)[:, 0]
        for r in range(seg.rows):
            at = slice(r * seg.width, (r + 1) * seg.width)
            expected[at, at] = rows[r]
        expected[tokens:, tokens:] = torch.ones(n - tokens, n - tokens, dtype=torch.bool).tril()
        assert torch.equal(implied, expected)


def test_the_compiled_kernel_compiles_once_for_five_packed_lengths():
    """Dynamic shapes: one dynamo frame for five padded lengths and five masks (new mask_mod closures),
    counted by a counting backend around the eager one (inductor's CPU flex template does not build with dynamic shapes;
    the graph and its guards, which decide recompiles, are the same). Head counts and head size are
    chosen apart from the tile counts (4, 6, 9, 11, 15): flex marks them static, and dynamo's duck
    sizing would tie an equal tile count to them (`compile_flex`)."""
    counter = CompileCounterWithBackend("eager")
    kernel = attention_flex.compile_flex(counter)
    g = torch.Generator().manual_seed(0)
    lengths = set()
    for s, width in enumerate((200, 330, 517, 700, 905)):
        seg = random_table(40 + s, rows=2, width=width, longest=200)
        mask = build(seg.lengths, seg.prefix, seg.rows * seg.width)
        lengths.add(mask.length // BLOCK)
        q, k, v = (torch.randn(1, h, mask.length, 16, generator=g) for h in (10, 5, 5))
        with torch.no_grad():
            out = kernel(q, k, v, block_mask=mask.block_mask, enable_gqa=True)
            ref = flex_attention(q, k, v, block_mask=mask.block_mask, enable_gqa=True)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert lengths == {4, 6, 9, 11, 15}
    assert counter.frame_count == 1


@pytest.mark.parametrize("tokens,length", [(1, 128), (128, 128), (129, 256), (1000, 1024)])
def test_the_padded_length_is_the_next_tile_multiple(tokens, length):
    assert attention_flex.padded_length(tokens) == length
