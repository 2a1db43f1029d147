"""One prompt per group: micro-batches in which a group's samples share one copy of their prompt.

The samples of a GRPO group (and the episodes of a multi-turn group) start with the same prompt; the
unshared layouts (`packing.packed`, `packing.padded`) compute it `group_size` times, forward and
backward. Here a micro-batch holds *blocks*: a block is the prompt's *prefix* (every prompt token but
the last) once, then one *suffix* per sample (the last prompt token and the sample's completion).
Position ids continue the prefix in every suffix (the last prompt token keeps its position), and a
4D boolean attention mask [B, 1, T, T] lets

- a prefix token attend causally to its prefix,
- a suffix token attend to its block's whole prefix and causally to its own suffix,
- nothing else (no token sees another sample's suffix, another block or padding).

So every suffix token sees exactly the keys it sees in the unshared layout, at the same positions:
log-probs are equal, and a prefix token's gradient is the sum over the suffixes that read it, as it
is over the copies in the unshared layout. Every scored position (the logit of the last prompt token
onwards) lies in the sample's own suffix, so the head reads no shared position twice. HF models take
such a mask as it is (`masking_utils`: a 4D mask is "already prepared") and pass it to SDPA.

Blocks are cut from runs of consecutive samples with the same prompt (the driver lists a shard's
samples group by group; a multi-turn episode's prompt is its initial prompt, its environment turns
are part of its completion). Micro-batches keep a run together when it fits
(`split_shared`); a run larger than a micro-batch is cut into several blocks, each with its own copy
of the prefix (exact too: each block is self-contained). Packed: blocks first-fit into rows of
`learner.pack_row_tokens` (a block longer than a row is cut the same way); padded: one block per row.
"""

from __future__ import annotations

import numpy as np
import torch

from async_rl.learner.batch.packing import (
    MicroBatch,
    SeqSample,
    _fill,
    _fill_optional,
    _optional,
    _route_rows,
    cut,
    loss_index,
    row_layout,
    row_tensors,
)
from async_rl.learner.batch.routes import put_routes
from async_rl.learner.batch.vision_rows import VisionRows
from async_rl.learner.model.attention import SegmentTable
from async_rl.models.cost import CostModel, Layout


def _prompt_key(s: SeqSample) -> bytes:
    """A prompt's identity: its tokens, and its images (equal placeholder tokens may hold other pixels).
    A sample with images of its own (an episode's environment turns) shares with no other: its block
    places its own images, which only its own sequence holds."""
    if s.vision is not None and s.vision.own:
        return b"own:" + id(s).to_bytes(8, "little")
    images = s.vision.key if s.vision is not None else b""
    return np.asarray(s.tokens[: s.start], dtype=np.int64).tobytes() + images


def prompt_runs(samples: list[SeqSample]) -> list[list[SeqSample]]:
    """Runs of consecutive samples with the same prompt (`tokens[:start]` and images), in order."""
    runs: list[list[SeqSample]] = []
    key = None
    for s in samples:
        k = _prompt_key(s)
        if runs and k == key:
            runs[-1].append(s)
        else:
            runs.append([s])
            key = k
    return runs


def prefix_len(s: SeqSample) -> int:
    """Tokens of the shared prefix: the prompt but its last token (whose logit starts the scoring)."""
    return s.start - 1


def suffix_len(s: SeqSample) -> int:
    return len(s.tokens) - prefix_len(s)


def block_tokens(run: list[SeqSample]) -> int:
    """Positions a block of these samples (one prompt) takes: its prefix once, every suffix."""
    return prefix_len(run[0]) + sum(suffix_len(s) for s in run)


def cut_run(run: list[SeqSample], max_tokens: int, max_seqs: int = 0) -> list[list[SeqSample]]:
    """`run` (one prompt) as blocks of at most `max_tokens` positions and `max_seqs` samples each
    (0 = no limit); a block holds at least one sample, whatever its length."""
    blocks: list[list[SeqSample]] = []
    for s in run:
        if blocks:
            b = blocks[-1]
            fits = (not max_tokens or block_tokens(b) + suffix_len(s) <= max_tokens) and (
                not max_seqs or len(b) < max_seqs
            )
            if fits:
                b.append(s)
                continue
        blocks.append([s])
    return blocks


def split_shared(samples: list[SeqSample], max_seqs: int, max_tokens: int) -> list[list[SeqSample]]:
    """Order-preserving micro-batches of at most `max_seqs` sequences and `max_tokens` positions (one
    prefix per prompt counted; 0 = no limit). A prompt's samples stay in one micro-batch whenever they
    fit in one: a run that does not fit the current micro-batch starts the next; a run larger than a
    whole micro-batch fills micro-batches sample by sample, each piece with its own prefix."""
    chunks: list[list[SeqSample]] = []
    current: list[SeqSample] = []
    used = 0

    def fits(extra_tokens: int, extra_seqs: int, base_tokens: int, base_seqs: int) -> bool:
        return (not max_tokens or base_tokens + extra_tokens <= max_tokens) and (
            not max_seqs or base_seqs + extra_seqs <= max_seqs
        )

    def flush() -> None:
        nonlocal current, used
        if current:
            chunks.append(current)
        current, used = [], 0

    for run in prompt_runs(samples):
        n = block_tokens(run)
        if fits(n, len(run), used, len(current)):
            current.extend(run)
            used += n
            continue
        if fits(n, len(run), 0, 0):
            flush()
            current.extend(run)
            used += n
            continue
        opened = False  # the current micro-batch holds this run's prefix already
        for s in run:
            cost = suffix_len(s) + (0 if opened else prefix_len(s))
            if current and not fits(cost, 1, used, len(current)):
                flush()
                cost, opened = suffix_len(s) + prefix_len(s), False
            current.append(s)
            used += cost
            opened = True
    flush()
    return chunks


def _suffix_sample(s: SeqSample) -> SeqSample:
    """The sample's suffix as a sample of its own (first token = the last prompt token), so that
    `packing._fill` lays out its targets and per-token values at the suffix's columns (and its routes'
    rows follow its tokens)."""
    p = prefix_len(s)
    return SeqSample(
        tokens=s.tokens[p:], start=1, behav_logp=s.behav_logp, advantages=s.advantages,
        prox_logp=s.prox_logp, ref_logp=s.ref_logp, in_loss=s.in_loss, loss_mask=s.loss_mask,
        cov_select=s.cov_select, routes=None if s.routes is None else s.routes[p:],
    )


def block_rows(
    samples: list[SeqSample], row_tokens: int, pack: bool
) -> tuple[list[list[SeqSample]], list[int], int, int]:
    """The blocks of `samples` (one prefix per prompt run, cut to rows of `row_tokens` when packed), the row
    of each block, the row count and the width: packed, first fit in rows (0 = the longest block); else
    one block per row."""
    blocks: list[list[SeqSample]] = []
    for run in prompt_runs(samples):
        blocks.extend(cut_run(run, row_tokens) if pack and row_tokens else [run])
    lengths = [block_tokens(b) for b in blocks]
    if pack:
        rows, n_rows, width = row_layout(lengths, row_tokens or max(lengths))
    else:
        rows, n_rows, width = list(range(len(blocks))), len(blocks), max(lengths)
    return blocks, rows, n_rows, width


def shared_layout(samples: list[SeqSample], row_tokens: int = 0, pack: bool = True) -> Layout:
    """The layout `shared` gives these samples, without building it (what `CostModel.layout` reads): per
    block its prefix, then its suffixes reading the prefix; a row's unused tail a segment of its own."""
    blocks, rows, n_rows, width = block_rows(samples, row_tokens, pack)
    per_row: list[list[tuple[int, int]]] = [[] for _ in range(n_rows)]
    for b, row in zip(blocks, rows, strict=True):
        p = prefix_len(b[0])
        per_row[row] += [(p, 0)] if p else []
        per_row[row] += [(suffix_len(s), p) for s in b]
    segments = []
    for row_segments in per_row:
        rest = width - sum(n for n, _ in row_segments)
        segments += row_segments + ([(rest, 0)] if rest else [])
    return Layout(n_rows, width, segments)


def shared(samples: list[SeqSample], row_tokens: int = 0, pack: bool = True) -> MicroBatch:
    """The micro-batch of `samples` with one prefix per prompt run. `pack`: blocks first-fit into
    rows of `row_tokens` positions (0 = the longest block; a longer block is cut into blocks that
    fit); else one block per row, right-padded. Spans (and so scores) follow the samples' order."""
    blocks, rows, n_rows, width = block_rows(samples, row_tokens, pack)
    input_ids, position_ids, targets, mask, behav, adv = row_tensors(n_rows, width)
    prox = _optional(samples, "prox_logp", (n_rows, width))
    ref = _optional(samples, "ref_logp", (n_rows, width))
    cov = _optional(samples, "cov_select", (n_rows, width))
    routes = _route_rows(samples, n_rows, width)
    span_of: dict[int, tuple[int, int, int]] = {}
    offsets = [0] * n_rows
    in_row: list[list[tuple[int, list[int]]]] = [[] for _ in range(n_rows)]  # per row: (prefix, suffixes)
    images = VisionRows()  # one placed prompt per block: its images once
    for b, row in zip(blocks, rows, strict=True):
        at = offsets[row]
        block_start = at
        p = prefix_len(b[0])
        input_ids[row, at : at + p] = torch.from_numpy(np.asarray(b[0].tokens[:p], dtype=np.int64))
        position_ids[row, at : at + p] = torch.arange(p)
        if routes is not None:  # the prefix's routes: its first sample's (one prompt, one engine forward)
            put_routes(routes[row], at, p, b[0].routes)
        at += p
        suffixes = []
        for s in b:
            sfx = _suffix_sample(s)
            n = len(sfx.tokens)
            input_ids[row, at : at + n] = torch.from_numpy(np.asarray(sfx.tokens, dtype=np.int64))
            position_ids[row, at : at + n] = torch.arange(p, p + n)
            if routes is not None:
                put_routes(routes[row], at, n, sfx.routes)
            first, k = _fill(targets[row], mask[row], behav[row], adv[row], at, sfx)
            _fill_optional(None if prox is None else prox[row], first, sfx.prox_logp)
            _fill_optional(None if ref is None else ref[row], first, sfx.ref_logp)
            _fill_optional(None if cov is None else cov[row], first, sfx.cov_select)
            span_of[id(s)] = (row, first, k)
            suffixes.append(n)
            at += n
        offsets[row] = at
        in_row[row].append((p, suffixes))
        images.place(row, block_start, at, p + 1, b[0].vision)  # the prefix and the first suffix token
    # The attention segments, row by row: a block's prefix, then its suffixes reading it; a row's
    # padding is a segment of its own (it sees only padding), its positions counting from 0.
    table = SegmentTable(width)
    for row, row_blocks in enumerate(in_row):
        for p, suffixes in row_blocks:
            prefix = table.add(p) if p else -1
            for n in suffixes:
                table.add(n, prefix)
        position_ids[row, offsets[row] :] = torch.arange(width - offsets[row])
        table.end_row("own")
    spans = [span_of[id(s)] for s in samples]
    return MicroBatch(input_ids, position_ids, None, targets, mask, behav, adv, spans, prox, ref, cov, table.build(),
                      loss_index(samples, spans, width), routes, images.build(position_ids, input_ids))


def shared_micro_batches(
    samples: list[SeqSample], pack: bool, max_seqs: int = 0, max_tokens: int = 0, row_tokens: int = 0,
    cost: CostModel | None = None,
) -> list[MicroBatch]:
    """`packing.micro_batches` with one prefix per prompt run (`learner.share_prompt`)."""
    of = None if cost is None else lambda chunk: cost.layout(shared_layout(chunk, row_tokens, pack))
    chunks = cut(split_shared, samples, max_seqs, max_tokens, of)
    return [shared(chunk, row_tokens, pack) for chunk in chunks]
