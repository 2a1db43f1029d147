"""What a micro-batch costs the learner, on the attention path that will run it: the one estimate the
buffer deals ranks by (`buffer/balance.py`) and every learner pass cuts micro-batches by (`learner/batch/cut.py`).

A micro-batch is `rows x width` token positions cut into attention segments (`attention.Segments`).
In units of one token's matmuls (`models.shape`: `attention_weight` w = one query-key pair's FLOPs over
one token's matmul FLOPs) it costs

    rows x width (every position, padding too, runs every matmul) + w x pairs(path)

where `pairs` is what the attention kernel computes, not what the causal rules need:

- `flash` (varlen flash attention and FlexAttention on CUDA): per segment of q queries reading its own
  q keys causally and a prefix of p keys whole, q x p + q^2 / 2 (tiles above the diagonal skipped).
- `dense` (SDPA, the CPU path; also the padded layout): a mask over the whole row, every tile computed:
  rows x width^2. Where every row is one sequence (no packing, no padding, no shared prefix) HF passes
  no mask and SDPA runs causal: rows x width^2 / 2.
- `segments` (`learner.attention: varlen` on CPU: `attention.reference_varlen`, SDPA per segment with
  an explicit mask): q x (p + q) per segment.

Measured (2026-11-28, tiny-qwen2-wide, fp32, one thread, forward and backward, CPU seconds; the
machine loaded by other runs): 2,048 positions as 8 rows of 256 took 2.01 s; as one row of eight
256-token sequences (dense mask, 2,048^2 pairs) 3.52 s and of sixteen 128-token ones 3.52 s (the width
counts, not the sequences); one 2,048-token sequence alone 2.80 s (causal, half the pairs); five rows of
1,024 (one 1,024-token sequence, four of 256 padded to its width) 6.06 s, 2.5x the positions. The
model's w (3.25e-4) predicts 1.00 : 1.60 : 1.28 : 2.80 for these, measured 1.00 : 1.75 : 1.39 : 3.01
(benchmarks/results/attention_cost_cpu.md: within 10% in every case but the one below).
The CPU varlen reference: eight 256-token segments in one row 2.02 s (per segment), one of 2,048 4.57 s
(1.42x the estimate: its explicit-mask SDPA is slower per pair on one long segment).

Before the micro-batches exist (the buffer's dealing) a sample's share is estimated alone
(`CostModel.sample`): under `dense` a sample shorter than `learner.pack_row_tokens` shares a masked row
of that width (L x (1 + w x row_tokens)); a longer one has its row (L + w L^2 / 2): what the learner's
cut (`packing.cost_cut`) makes of a long one. With `pack_row_tokens` 0 (rows as wide as a micro-batch's
longest sequence) every sample is estimated as having its row, which undercounts short samples sharing a
masked row (about L x w x the row's width, not L^2 / 2): their attention is the small term, and the
dealing's error there is that share of their cost. The sum of the samples' shares is not the executed
cost (rows partly filled, padding); `layout` of a built micro-batch is.
"""

from __future__ import annotations

import msgspec

from async_rl.protocol import AttentionPath


def path_of(kernel: str, device_type: str) -> AttentionPath:
    """The cost path of a `learner.attention` kernel (resolved: sdpa, varlen, flex) on a device type."""
    if kernel == "sdpa":
        return "dense"
    return "flash" if device_type == "cuda" else "segments"


class Layout(msgspec.Struct, frozen=True):
    """A micro-batch's shape as the cost sees it: rows x width positions, and per attention segment
    (queries, prefix keys): its own tokens and the shared prefix it also reads (0: none)."""

    rows: int
    width: int
    segments: list[tuple[int, int]]

    @property
    def one_sequence_per_row(self) -> bool:
        return len(self.segments) == self.rows and all(p == 0 for _, p in self.segments)


class CostModel(msgspec.Struct, frozen=True, kw_only=True):
    """The learner's cost estimate: the model's `attention_weight`, the attention path that runs, and
    the packed rows' width (`learner.pack_row_tokens`, 0 = as wide as a micro-batch's longest)."""

    attention_weight: float = 0.0
    path: AttentionPath = "flash"
    row_tokens: int = 0

    def pairs(self, layout: Layout) -> float:
        """Query-key pairs the path's kernel computes for `layout` (the module's docstring)."""
        if self.path == "dense":
            square = layout.rows * layout.width * layout.width
            return square / 2 if layout.one_sequence_per_row else float(square)
        if self.path == "flash":
            return sum(q * p + q * q / 2 for q, p in layout.segments)
        return float(sum(q * (p + q) for q, p in layout.segments))

    def layout(self, layout: Layout) -> float:
        """The executed cost of a micro-batch of this layout, in token-matmul units."""
        return layout.rows * layout.width + self.attention_weight * self.pairs(layout)

    def sample(self, length: int) -> float:
        """A sample's estimated share of its rank's cost, before micro-batches are cut."""
        if self.path == "dense" and length < self.row_tokens:
            return length * (1 + self.attention_weight * self.row_tokens)
        return self.layout(Layout(1, length, [(length, 0)]))


def deal(costs: list[float], bins: int, per_bin: int | None = None) -> list[int]:
    """The bin each item goes to: largest cost first (ties in index order), each to the least-loaded bin
    that still has room (`per_bin` items at most; None: no limit). A function of the costs alone, so
    every rank that computes it from the same costs deals the same way: the buffer's shards
    (`buffer/balance.py`), the reference pass's micro-batches shared over an SP group (`learner/rl/reference.py`)."""
    load, count, owner = [0.0] * bins, [0] * bins, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        b = min((b for b in range(bins) if per_bin is None or count[b] < per_bin), key=load.__getitem__)
        owner[i] = b
        load[b] += costs[i]
        count[b] += 1
    return owner


TOKENS = CostModel()  # weight 0, no padding: a sample costs its tokens (the dealing before the learner says more)
