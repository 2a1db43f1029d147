"""Batch layout for the learner: sequences -> micro-batches, packed (padding-free) or padded.

Packed: the sequences of a micro-batch are concatenated into rows of bounded width (first fit), with
position ids that restart at 0 for every sequence. Hugging Face models turn such position ids (with no attention mask and no
KV cache) into a block-diagonal causal mask (`find_packed_sequence_indices`), flash-attention into
varlen kernels, so no token attends across a sequence boundary and no compute is spent on padding.
Padded: one row per sequence, right-padded, with an attention mask. Both layouts give the same
log-probs (unit-tested); padded is kept as the reference and for models that ignore position ids.

Per-token tensors (targets, loss mask, behaviour log-probs, advantages) are aligned with the
*logits*: column t holds what the logit at t predicts, i.e. token t + 1 of the same sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from async_rl.learner.batch.routes import put_routes, route_table
from async_rl.learner.batch.vision_rows import SampleVision, VisionBatch, VisionRows
from async_rl.learner.model.attention import (
    LAYOUT_KWARG,
    SDPA,
    AttentionLayout,
    KernelChoice,
    Segments,
    SegmentTable,
    dense_mask,
    layout_for,
)
from async_rl.learner.model.attention import position_ids as segment_positions
from async_rl.learner.model.head import flat_index
from async_rl.models.cost import CostModel, Layout

T = TypeVar("T")  # what a cut orders and groups: samples, or the rows of a padded shard (their indices)


@dataclass
class SeqSample:
    """One completion with its prompt. `advantages` is per completion token (a scalar broadcast by
    outcome-reward estimators, a real per-token value for GAE)."""

    tokens: np.ndarray  # int [prompt_len + completion_len]
    start: int  # index in `tokens` of the first completion token (>= 1)
    behav_logp: np.ndarray  # float32 [completion_len]
    advantages: np.ndarray  # float32 [completion_len]
    prox_logp: np.ndarray | None = None  # float32 [completion_len]: decoupled objective only
    ref_logp: np.ndarray | None = None  # float32 [completion_len]: KL penalty as a loss term only
    cov_select: np.ndarray | None = None  # float32 0/1 [completion_len]: algorithm.cov_control only
    in_loss: bool = True  # False: scored but adds no loss (algorithm.overlong=mask on a truncated one)
    loss_mask: np.ndarray | None = None  # per completion token 0/1: 0 on environment tokens (None: all 1)
    # an MoE model's recorded routes [len(tokens) - 1, moe_layers, top_k] (protocol.py; batch/routes.py)
    routes: np.ndarray | None = None
    vision: SampleVision | None = None  # a vision-language prompt's images (its group's, shared)

    @property
    def completion_len(self) -> int:
        return len(self.tokens) - self.start


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # long [B, T]
    position_ids: torch.Tensor | None  # long [B, T], packed and shared-prefix layouts
    # long [B, T] (padded layout: 1 on tokens); the shared-prefix layout's block mask is built from
    # `segments` on the device (`attention.dense_mask`)
    attention_mask: torch.Tensor | None
    targets: torch.Tensor  # long [B, T]
    loss_mask: torch.Tensor  # float32 [B, T]
    behav_logp: torch.Tensor  # float32 [B, T]
    advantages: torch.Tensor  # float32 [B, T]
    spans: list[tuple[int, int, int]]  # per sequence: (row, logit column of its first completion token, length)
    prox_logp: torch.Tensor | None = None  # float32 [B, T], when the samples carry it
    ref_logp: torch.Tensor | None = None  # float32 [B, T], when the samples carry it
    cov_select: torch.Tensor | None = None  # float32 0/1 [B, T], when the samples carry it
    # how the rows cut into attention segments (`attention.py`): the torch learner builds its position
    # ids and masks (or varlen/flex layout) from it on the device
    segments: Segments | None = None
    # long [N]: the flat (row * width + column) indices of the loss positions (loss_mask != 0), built on
    # the host from the samples when the batch is packed, so the head gathers them on the device with
    # no data-dependent sync (a `nonzero` per micro-batch); None: `head_index` derives it from the mask
    loss_index: torch.Tensor | None = None
    # int32 [B, T, moe_layers, top_k]: the experts to replay per input token (`batch/routes.py`); None
    # when no sample carries routes
    routes: torch.Tensor | None = None
    # the placed prompts' images and 3-D positions (`batch/vision_rows.py`); None: no sample has images
    vision: VisionBatch | None = None

    @property
    def loss_tokens(self) -> int:
        """Tokens that carry loss: the model's completion tokens (a multi-turn episode's environment
        tokens and the samples left out of the loss add none)."""
        return int(self.loss_mask.sum())

    def span_positions(self) -> torch.Tensor:
        """bool [B, T]: the logit columns of its sequences' completion tokens (what scoring reads)."""
        out = torch.zeros(self.targets.shape, dtype=torch.bool, device=self.targets.device)
        for row, col, length in self.spans:
            out[row, col : col + length] = True
        return out

    def model_inputs(
        self, device: torch.device, kernels: KernelChoice = SDPA
    ) -> dict[str, torch.Tensor | bool | AttentionLayout]:
        """The HF forward's keyword arguments under `learner.attention` (`attention.py`): position ids and
        the SDPA mask (or the varlen/flex layout) built on `device` from the segment table; a padded
        layout's SDPA path keeps its 2D padding mask."""
        inputs: dict[str, torch.Tensor | bool | AttentionLayout] = {
            "input_ids": self.input_ids.to(device), "use_cache": False,
        }
        seg = None if self.segments is None else self.segments.to(device)
        kernel = "sdpa" if seg is None else kernels.of(seg)
        if seg is None or (kernel == "sdpa" and self.attention_mask is not None):
            if self.position_ids is not None:
                inputs["position_ids"] = self.position_ids.to(device)
            if self.attention_mask is not None:
                inputs["attention_mask"] = self.attention_mask.to(device)
            return self._with_images(inputs, device)
        inputs["position_ids"] = segment_positions(seg)
        if kernel == "sdpa":
            if seg.shares_prefixes:
                inputs["attention_mask"] = dense_mask(seg)
        else:
            inputs[LAYOUT_KWARG] = layout_for(seg, kernel)
        return self._with_images(inputs, device)

    def _with_images(self, inputs: dict, device: torch.device) -> dict:
        """A vision-language micro-batch's images and, with 3-D positions, position ids [4, B, T] (the 1-D
        ones first: the model's packed-sequence mask reads them)."""
        if self.vision is None:
            return inputs
        v = self.vision.to(device)  # the learner's forward embeds them (`model/vision_embed.py`)
        inputs["pixel_values"], inputs["image_mask"] = v.pixel_values, v.image_mask
        if v.image_grid_thw is not None:  # Qwen-VL's per-image grids; a fixed-size family has none
            inputs["image_grid_thw"] = v.image_grid_thw
        if v.rope is not None:
            flat = inputs.get("position_ids")
            if flat is None:  # the padded layout: positions count from 0 in every row
                flat = torch.arange(self.input_ids.shape[1], device=device).expand(self.input_ids.shape[0], -1)
            inputs["position_ids"] = torch.cat([flat.unsqueeze(0), v.rope])
        return inputs

    def per_sequence(self, logp: torch.Tensor) -> list[np.ndarray]:
        """Completion-token values of a [B, T] tensor, one float32 array per sequence, in order."""
        host = logp.detach().float().cpu()
        return [host[row, col : col + length].numpy().copy() for row, col, length in self.spans]

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            position_ids=None if self.position_ids is None else self.position_ids.to(device),
            attention_mask=None if self.attention_mask is None else self.attention_mask.to(device),
            targets=self.targets.to(device),
            loss_mask=self.loss_mask.to(device),
            behav_logp=self.behav_logp.to(device),
            advantages=self.advantages.to(device),
            spans=self.spans,
            prox_logp=None if self.prox_logp is None else self.prox_logp.to(device),
            ref_logp=None if self.ref_logp is None else self.ref_logp.to(device),
            cov_select=None if self.cov_select is None else self.cov_select.to(device),
            segments=None if self.segments is None else self.segments.to(device),
            loss_index=None if self.loss_index is None else self.loss_index.to(device),
            routes=None if self.routes is None else self.routes.to(device),
            vision=None if self.vision is None else self.vision.to(device),
        )

    def head_index(self) -> torch.Tensor:
        """long [N]: the flat indices of the loss positions (the prebuilt `loss_index`, else the mask's)."""
        return self.loss_index if self.loss_index is not None else flat_index(self.loss_mask != 0)

    def span_index(self) -> torch.Tensor:
        """long [N]: the flat indices of its sequences' completion positions (what scoring reads),
        from `spans` alone (no data-dependent op)."""
        width = self.targets.shape[1]
        return torch.from_numpy(span_flat_index([(row * width + col, n) for row, col, n in self.spans]))


def span_flat_index(starts: list[tuple[int, int]]) -> np.ndarray:
    """int64 [sum n]: start, start + 1, ..., start + n - 1 for each (start, n), in order."""
    if not starts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in starts])


def loss_index(samples: list[SeqSample], spans: list[tuple[int, int, int]], width: int) -> torch.Tensor:
    """long [N]: the flat indices (row * width + column) of the loss positions of `samples` placed at
    `spans` (in the same order), ascending as `nonzero` of the loss mask gives them: a sample out of the
    loss adds none, one with a `loss_mask` its nonzero tokens, any other its whole completion. Built from
    the host-side samples, with numpy: no tensor value is read."""
    parts = []
    for s, (row, first, n) in zip(samples, spans, strict=True):
        if not s.in_loss:
            continue
        at = np.arange(row * width + first, row * width + first + n, dtype=np.int64)
        parts.append(at if s.loss_mask is None else at[np.asarray(s.loss_mask) != 0])
    flat = np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(flat)


def tokens_of(s: SeqSample) -> int:
    """A sample's tokens (prompt + completion): what the token cut counts."""
    return len(s.tokens)


def split(items: list[T], max_seqs: int, max_tokens: int, size: Callable[[T], int] = tokens_of) -> list[list[T]]:
    """Greedy, order-preserving micro-batches of at most `max_seqs` sequences and `max_tokens`
    tokens (`size` of each: a sample's prompt + completion; 0 = no limit). A sequence longer than
    `max_tokens` goes alone."""
    chunks: list[list[T]] = []
    current: list[T] = []
    used = 0
    for s in items:
        n = size(s)
        full = (max_seqs and len(current) >= max_seqs) or (max_tokens and used + n > max_tokens)
        if current and full:
            chunks.append(current)
            current, used = [], 0
        current.append(s)
        used += n
    if current:
        chunks.append(current)
    return chunks


def balanced(
    splitter: Callable[[list[T], int, int], list[list[T]]], samples: list[T], max_seqs: int, max_tokens: int
) -> list[list[T]]:
    """`splitter`'s order-preserving micro-batches, balanced: as few as under `max_tokens`, cut under the
    smallest token cap that still gives that few (a binary search over the cap, each try one greedy
    pass), so the largest micro-batch is as small as it can be. Bound: for the plain split no
    micro-batch holds more than total / count + the longest sequence (a cut at every count-th of the
    total is off by at most one sequence), and none more than `max_tokens` unless a single sequence
    does. Without a token limit (0) the splitter's cut is kept."""
    chunks = splitter(samples, max_seqs, max_tokens)
    if not max_tokens or len(chunks) < 2:
        return chunks
    lo, hi = 1, max_tokens  # hi: a cap known to give len(chunks)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(splitter(samples, max_seqs, mid)) <= len(chunks):
            hi = mid
        else:
            lo = mid + 1
    return splitter(samples, max_seqs, hi) if hi < max_tokens else chunks


# A micro-batch is cut in two only where that saves at least this share of its estimated cost: a cut adds a
# forward and backward whose fixed costs the estimate does not count (the weights read again, FSDP's
# all-gathers, a head pass), and for samples of similar lengths no cut saves this much, so the token cut stands.
SPLIT_GAIN = 0.25


def cost_cut(
    chunks: list[list[T]], cost: Callable[[list[T]], float], size: Callable[[T], int] = tokens_of
) -> list[list[T]]:
    """`chunks` (in order) with each one cut, in order, where the `cost` of a micro-batch says that its
    longest sample sets the others' cost: a chunk is cut just before its longest sample, just after it, or
    both, each piece cut again the same way, when that saves SPLIT_GAIN of its cost (the cheapest of the
    three, judged by what the pieces cost once cut again: a second long sample in a piece no longer keeps
    the cut from paying). Under a masked SDPA (CPU) a packed micro-batch is as wide as its longest row, so
    short rows beside a long sample each cost that width's positions and its square; cut off, they cost
    their own width. Every sample stays in exactly one micro-batch, in its order. `size`: a sample's tokens."""
    return [piece for chunk in chunks for piece in _cheapest_cut(chunk, cost, size)]


def _cheapest_cut(chunk: list[T], cost: Callable[[list[T]], float], size: Callable[[T], int]) -> list[list[T]]:
    """`cost_cut` of one chunk, over its index ranges [a, b): each range judged once, after the ranges its
    options cut it into (a stack, not recursion: a chunk of ascending lengths is as deep as it is long)."""
    if not chunk:
        return []
    splits: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}
    best: dict[tuple[int, int], tuple[float, list[tuple[int, int]]]] = {}

    def options(a: int, b: int) -> list[list[tuple[int, int]]]:
        if (a, b) not in splits:
            m = max(range(a, b), key=lambda i: size(chunk[i]))
            ends = [i for i in (m, m + 1) if a < i < b]
            both = [[(a, m), (m, m + 1), (m + 1, b)]] if len(ends) == 2 else []
            splits[(a, b)] = [[(a, i), (i, b)] for i in ends] + both
        return splits[(a, b)]

    todo = [(0, len(chunk))]
    while todo:
        a, b = todo[-1]
        if (a, b) in best:
            todo.pop()
            continue
        missing = [r for option in options(a, b) for r in option if r not in best]
        if missing:
            todo += missing
            continue
        todo.pop()
        whole = cost(chunk[a:b])
        kept = (whole, [(a, b)])
        for option in options(a, b):
            split_cost = sum(best[r][0] for r in option)
            if split_cost <= (1 - SPLIT_GAIN) * whole and split_cost < kept[0]:
                kept = (split_cost, [piece for r in option for piece in best[r][1]])
        best[(a, b)] = kept
    return [chunk[a:b] for a, b in best[(0, len(chunk))][1]]


def cut(
    splitter: Callable[[list[T], int, int], list[list[T]]], items: list[T], max_seqs: int, max_tokens: int,
    cost: Callable[[list[T]], float] | None, size: Callable[[T], int] = tokens_of,
) -> list[list[T]]:
    """The cut of every micro-batch layout: `items` in order, by tokens (`balanced` over `splitter`), then
    by `cost` (`cost_cut`, the executed cost of a micro-batch of the items) where given."""
    chunks = balanced(splitter, items, max_seqs, max_tokens)
    return chunks if cost is None else cost_cut(chunks, cost, size)


def packed_layout(lengths: list[int], row_tokens: int = 0) -> Layout:
    """The layout `packed` gives sequences of these lengths (first fit in rows of `row_tokens`, 0 = the
    longest; a row's tail lengthens its last sequence), without building it: what `CostModel.layout` reads."""
    rows, n_rows, width = row_layout(lengths, row_tokens or max(lengths))
    per_row: list[list[int]] = [[] for _ in range(n_rows)]
    for n, row in zip(lengths, rows, strict=True):
        per_row[row].append(n)
    segments = []
    for row_lengths in per_row:
        row_lengths[-1] += width - sum(row_lengths)
        segments += [(n, 0) for n in row_lengths]
    return Layout(n_rows, width, segments)


def padded_layout(lengths: list[int]) -> Layout:
    """The layout `padded` gives: one row per sequence, its padding a segment of its own."""
    width = max(lengths)
    return Layout(len(lengths), width, [(m, 0) for n in lengths for m in (n, width - n) if m])


def chunk_cost(cost: CostModel, pack: bool, row_tokens: int) -> Callable[[list[SeqSample]], float]:
    """The executed cost of a micro-batch of these samples in the unshared layouts (`cost_cut`'s measure)."""
    def of(chunk: list[SeqSample]) -> float:
        lengths = [len(s.tokens) for s in chunk]
        return cost.layout(packed_layout(lengths, row_tokens) if pack else padded_layout(lengths))

    return of


def _optional(samples: list[SeqSample], field: str, shape: tuple[int, int]) -> torch.Tensor | None:
    return torch.zeros(shape) if getattr(samples[0], field) is not None else None


def _route_rows(samples: list[SeqSample], n_rows: int, width: int) -> torch.Tensor | None:
    """The micro-batch's route tensor (all padding) when a sample carries routes, else None."""
    first = next((s.routes for s in samples if s.routes is not None), None)
    return None if first is None else route_table(n_rows, width, first.shape[1:])


def _fill_optional(row: torch.Tensor | None, first: int, values: np.ndarray | None) -> None:
    if row is not None:
        row[first : first + len(values)] = torch.from_numpy(np.asarray(values, dtype=np.float32))


def _fill(row_targets, row_mask, row_behav, row_adv, offset: int, s: SeqSample) -> tuple[int, int]:
    length = len(s.tokens)
    tokens = torch.from_numpy(np.asarray(s.tokens, dtype=np.int64))
    row_targets[offset : offset + length - 1] = tokens[1:]
    first = offset + s.start - 1  # the logit that predicts the first completion token
    n = s.completion_len
    if not s.in_loss:
        row_mask[first : first + n] = 0.0
    elif s.loss_mask is None:
        row_mask[first : first + n] = 1.0
    else:
        row_mask[first : first + n] = torch.from_numpy(np.asarray(s.loss_mask, dtype=np.float32))
    row_behav[first : first + n] = torch.from_numpy(np.asarray(s.behav_logp, dtype=np.float32))
    row_adv[first : first + n] = torch.from_numpy(np.asarray(s.advantages, dtype=np.float32))
    return first, n


def pack_rows(lengths: list[int], width: int) -> list[int]:
    """First-fit: the row index of each sequence, rows holding at most `width` tokens (a sequence
    longer than `width` gets a row of its own)."""
    free: list[int] = []
    rows = []
    for n in lengths:
        row = next((i for i, f in enumerate(free) if f >= n), len(free))
        if row == len(free):
            free.append(max(width, n))
        free[row] -= n
        rows.append(row)
    return rows


def row_layout(lengths: list[int], width: int) -> tuple[list[int], int, int]:
    """(the row of each item, first fit in rows of `width`; the row count; the widest row's use)."""
    rows = pack_rows(lengths, width)
    n_rows = max(rows) + 1
    used = [0] * n_rows
    for row, n in zip(rows, lengths, strict=True):
        used[row] += n
    return rows, n_rows, max(used)


def row_tensors(n_rows: int, width: int) -> tuple[torch.Tensor, ...]:
    """Zeroed input_ids, position_ids, targets (long) and loss mask, behaviour log-probs, advantages
    (float32), each [n_rows, width]."""
    longs = [torch.zeros(n_rows, width, dtype=torch.long) for _ in range(3)]
    return (*longs, *(torch.zeros(n_rows, width) for _ in range(3)))


def packed(samples: list[SeqSample], row_tokens: int = 0) -> MicroBatch:
    """`samples` concatenated into rows of `row_tokens` tokens (0 = the longest sequence), position
    ids restarting at 0 for every sequence. Rows are bounded because, without a varlen attention
    kernel (CPU, SDPA), a packed row costs attention over its whole width squared: one row of 128
    sequences of 80 tokens trained 20x slower than the same sequences in rows of 80."""
    lengths = [len(s.tokens) for s in samples]
    rows, n_rows, width = row_layout(lengths, row_tokens or max(lengths))
    input_ids, position_ids, targets, mask, behav, adv = row_tensors(n_rows, width)
    # A row's unused tail continues its last sequence's positions: no extra sequence boundary, and
    # being after every real token, the causal mask keeps it from affecting them (loss mask 0).
    prox = _optional(samples, "prox_logp", (n_rows, width))
    ref = _optional(samples, "ref_logp", (n_rows, width))
    cov = _optional(samples, "cov_select", (n_rows, width))
    routes = _route_rows(samples, n_rows, width)
    spans = []
    offsets = [0] * n_rows
    images = VisionRows()
    for s, row in zip(samples, rows, strict=True):
        offset, length = offsets[row], len(s.tokens)
        images.place(row, offset, offset + length, s.start, s.vision)
        input_ids[row, offset : offset + length] = torch.from_numpy(np.asarray(s.tokens, dtype=np.int64))
        if routes is not None:
            put_routes(routes[row], offset, length, s.routes)
        position_ids[row, offset:] = torch.arange(width - offset)
        first, n = _fill(targets[row], mask[row], behav[row], adv[row], offset, s)
        _fill_optional(None if prox is None else prox[row], first, s.prox_logp)
        _fill_optional(None if ref is None else ref[row], first, s.ref_logp)
        _fill_optional(None if cov is None else cov[row], first, s.cov_select)
        spans.append((row, first, n))
        offsets[row] += length
    table = SegmentTable(width)
    for r in range(n_rows):
        for n in (length for length, row in zip(lengths, rows, strict=True) if row == r):
            table.add(n)
        table.end_row("extend")
    return MicroBatch(input_ids, position_ids, None, targets, mask, behav, adv, spans, prox, ref, cov, table.build(),
                      loss_index(samples, spans, width), routes, images.build(position_ids, input_ids))


def padded(samples: list[SeqSample]) -> MicroBatch:
    """One right-padded row per sample, with an attention mask."""
    width = max(len(s.tokens) for s in samples)
    n_rows = len(samples)
    input_ids = torch.zeros(n_rows, width, dtype=torch.long)
    attention_mask = torch.zeros(n_rows, width, dtype=torch.long)
    targets = torch.zeros(n_rows, width, dtype=torch.long)
    mask, behav, adv = (torch.zeros(n_rows, width) for _ in range(3))
    prox, ref = _optional(samples, "prox_logp", (n_rows, width)), _optional(samples, "ref_logp", (n_rows, width))
    cov = _optional(samples, "cov_select", (n_rows, width))
    routes = _route_rows(samples, n_rows, width)
    spans = []
    images = VisionRows()
    for i, s in enumerate(samples):
        length = len(s.tokens)
        images.place(i, 0, length, s.start, s.vision)
        input_ids[i, :length] = torch.from_numpy(np.asarray(s.tokens, dtype=np.int64))
        if routes is not None:
            put_routes(routes[i], 0, length, s.routes)
        attention_mask[i, :length] = 1
        first, n = _fill(targets[i], mask[i], behav[i], adv[i], 0, s)
        _fill_optional(None if prox is None else prox[i], first, s.prox_logp)
        _fill_optional(None if ref is None else ref[i], first, s.ref_logp)
        _fill_optional(None if cov is None else cov[i], first, s.cov_select)
        spans.append((i, first, n))
    table = SegmentTable(width)
    for s in samples:
        table.add(len(s.tokens))
        table.end_row("own")
    positions = torch.arange(width).expand(n_rows, -1)
    return MicroBatch(input_ids, None, attention_mask, targets, mask, behav, adv, spans, prox, ref, cov, table.build(),
                      loss_index(samples, spans, width), routes, images.build(positions, input_ids))


def micro_batches(
    samples: list[SeqSample], pack: bool, max_seqs: int = 0, max_tokens: int = 0, row_tokens: int = 0,
    cost: CostModel | None = None,
) -> list[MicroBatch]:
    """`samples` in order as micro-batches: cut by tokens, then by `cost` where given (`cut`)."""
    chunks = cut(split, samples, max_seqs, max_tokens, None if cost is None else chunk_cost(cost, pack, row_tokens))
    return [packed(chunk, row_tokens) if pack else padded(chunk) for chunk in chunks]


def dummy_micro_batch() -> MicroBatch:
    """One token, nothing to learn: a rank with fewer micro-batches than its peers runs these so
    every rank enters the same number of forward/backward collectives (FSDP all-gathers per call)."""
    zeros = torch.zeros(1, 1)
    return MicroBatch(
        torch.zeros(1, 1, dtype=torch.long), None, None, torch.zeros(1, 1, dtype=torch.long),
        zeros, zeros.clone(), zeros.clone(), [],
    )
