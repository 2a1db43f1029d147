"""A learner shard as padded rows: one row per completion with its prompt, right-padded.

The torch backend's algorithm prepares on it (advantages and the no-grad passes) before the packed
micro-batches; the megatron backend trains on it directly (its schedules take fixed shapes). Loss
positions index the *targets* (input shifted by one). A multi-turn episode's loss mask has holes:
its environment tokens are inputs (the model saw them) but carry no loss. Rewards are per episode:
the segments of a split agent episode are rows of their own that map to one episode.
"""

from __future__ import annotations

import numpy as np
import torch

from async_rl.learner.batch.routes import put_routes, route_table
from async_rl.protocol import FINISH_LENGTH, TrajectoryGroup


def episode_rows(groups: list[TrajectoryGroup]) -> torch.Tensor:
    """Per row (one per sample, groups in order), its episode in the flat [groups * episodes] order of
    the shard's rewards: arange(rows) unless an agent episode was split into several samples."""
    rows, base = [], 0
    for g in groups:
        rows += [base + e for e in g.episode_index()]
        base += g.episode_count
    return torch.tensor(rows, dtype=torch.long)


class PaddedShard:
    def __init__(self, groups: list[TrajectoryGroup], with_routes: bool = False) -> None:
        """`with_routes`: lay out the groups' recorded routes too (`routes`, for an MoE reference pass)."""
        seqs, behav, teacher, starts, lengths, masks = [], [], [], [], [], []
        for g in groups:
            for i, (comp, lp) in enumerate(zip(g.completions, g.logprobs, strict=True)):
                seqs.append(np.concatenate([g.prompt_tokens, comp]))
                behav.append(lp)
                teacher.append(g.teacher_logprob(i))
                starts.append(len(g.prompt_tokens) - 1)
                lengths.append(len(comp))
                masks.append(g.loss_mask(i))
        width = max(len(s) for s in seqs)
        n = len(seqs)
        self.input_ids = torch.zeros(n, width, dtype=torch.long)
        self.attention_mask = torch.zeros(n, width, dtype=torch.long)
        self.behav_logp = torch.zeros(n, width - 1)
        self.loss_mask = torch.zeros(n, width - 1)
        # on-policy distillation: the teacher's log-probs where it scored a sample (teacher_mask 1)
        self.teacher_logp = torch.zeros(n, width - 1)
        self.teacher_mask = torch.zeros(n, width - 1)
        for i, (s, lp, start, length, m) in enumerate(zip(seqs, behav, starts, lengths, masks, strict=True)):
            self.input_ids[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
            self.attention_mask[i, : len(s)] = 1
            self.behav_logp[i, start : start + length] = torch.from_numpy(np.array(lp, dtype=np.float32))
            self.loss_mask[i, start : start + length] = torch.from_numpy(m.astype(np.float32))
            if teacher[i] is not None:
                self.teacher_logp[i, start : start + length] = torch.from_numpy(np.array(teacher[i], dtype=np.float32))
                self.teacher_mask[i, start : start + length] = 1.0
        # One reward per episode, [groups, episodes]: a split agent episode's segments (rows) share
        # its reward and count once in its group's statistics; `episode_rows` maps rows to episodes.
        self.rewards = torch.tensor(
            [[g.rewards[i] for i in g.episode_last_samples()] for g in groups], dtype=torch.float32
        )
        self.episode_rows = episode_rows(groups)
        self.completion_lens = torch.tensor(lengths, dtype=torch.long)
        # cut at max_tokens (finish reason length): algorithm.overlong decides what they count for
        self.truncated = torch.tensor(
            [fr == FINISH_LENGTH for g in groups for fr in (g.finish_reasons or [0] * g.size)], dtype=torch.bool
        )
        # an MoE shard's recorded routes, row by row (the reference pass replays them)
        self.routes = None
        first = next((r for g in groups if g.routes is not None for r in g.routes), None) if with_routes else None
        if first is not None:
            self.routes = route_table(n, width, first.shape[1:])
            rows = [r for g in groups for r in (g.routes if g.routes is not None else [None] * g.size)]
            for i, (s, r) in enumerate(zip(seqs, rows, strict=True)):
                put_routes(self.routes[i], 0, len(s), r)
        self.seqs = seqs
        self.starts = starts
        self.lengths = lengths
        self.tokens = int(sum(lengths))
        self.model_tokens = int(sum(int(m.sum()) for m in masks))  # tokens that carry loss
        self.teacher_missing = sum(1 for t in teacher if t is None)  # samples no teacher scored
