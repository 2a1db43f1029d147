"""How every pass of the learner lays out its micro-batches: one cut, made in one place.

The training pass, the no-grad scoring passes (the proximal log-probs and the hidden states the PPO
critic reads, the MoE routing probe, `compute_logprobs` and the probe against the engines) and the KL
reference pass all cut a shard in order by tokens (`packing.balanced`: as few micro-batches as
`learner.micro_batch_tokens` allows, as even as can be), then by the learner's cost estimate
(`packing.cost_cut`, `models/cost.py`): a long sample whose width would set its neighbours' cost goes
to a micro-batch of its own. The driver builds one `MicroBatchCut` with its cost model and hands it to
every pass; no pass holds a token budget of its own, so none can cut by tokens alone by omission.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import msgspec

from async_rl.learner.batch.packing import MicroBatch, SeqSample, cut, micro_batches, padded_layout, split
from async_rl.learner.batch.shared_prefix import shared_micro_batches
from async_rl.models.cost import CostModel
from async_rl.protocol import AttentionPath


@dataclass(frozen=True, kw_only=True)
class MicroBatchCut:
    """The learner's micro-batch settings with the cost model they are cut by (`cost` None: by tokens
    alone, a comparison). `max_seqs`, `max_tokens`: `learner.micro_batch_size`, the resolved
    `learner.micro_batch_tokens` (0: no limit); `pack`, `row_tokens`, `share_prompt`: the layout."""

    cost: CostModel | None
    pack: bool = True
    max_seqs: int = 0
    max_tokens: int = 0
    row_tokens: int = 0
    share_prompt: bool = False

    def micro_batches(self, samples: list[SeqSample]) -> list[MicroBatch]:
        """`samples` in order as micro-batches in the learner's layout."""
        build = shared_micro_batches if self.share_prompt else micro_batches
        return build(samples, self.pack, self.max_seqs, self.max_tokens, self.row_tokens, self.cost)

    def padded_rows(self, lengths: list[int], path: AttentionPath) -> list[list[int]]:
        """The rows of a padded shard (one sequence each, of `lengths` tokens; the KL reference pass) in
        order as micro-batches of row indices: the same cut, costed as padded rows (`packing.padded_layout`)
        on the attention path `path` of the kernel that scores them."""
        rows, size = list(range(len(lengths))), lengths.__getitem__
        cost = None if self.cost is None else msgspec.structs.replace(self.cost, path=path)

        def of(chunk: list[int]) -> float:
            return cost.layout(padded_layout([lengths[i] for i in chunk]))

        return cut(partial(split, size=size), rows, self.max_seqs, self.max_tokens, None if cost is None else of, size)

    def with_max_tokens(self, max_tokens: int) -> MicroBatchCut:
        """The same cut under another token budget (a pass that runs whole sequences under sequence
        parallelism gets one rank's share)."""
        return dataclasses.replace(self, max_tokens=max_tokens)


ONE_MICRO_BATCH = MicroBatchCut(cost=None, pack=False)  # no budget and no cost: a shard in one micro-batch
