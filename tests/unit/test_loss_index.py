"""The head's loss-position index, built on the host from the samples when a micro-batch is packed
(`packing.loss_index`), is the loss mask's `nonzero` in every layout: packed, padded and shared-prompt,
with multi-turn holes and samples left out of the loss; and the scoring index is the spans' positions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from async_rl.learner.batch.packing import packed, padded
from async_rl.learner.batch.shared_prefix import shared
from async_rl.learner.driver import shard_samples
from async_rl.learner.model.head import flat_index
from tests.unit._learner_fixtures import episode_groups


def with_holes(samples):
    """Every third sample out of the loss, every other one with environment tokens (0s) in its mask."""
    out = []
    for i, s in enumerate(samples):
        n = s.completion_len
        if i % 3 == 2:
            out.append(dataclasses.replace(s, in_loss=False))
        elif i % 2:
            out.append(dataclasses.replace(s, loss_mask=(np.arange(n) % 3 != 1).astype(np.int8)))
        else:
            out.append(s)
    return out


@pytest.mark.parametrize("layout", ["packed", "packed_rows", "padded", "shared", "shared_padded"])
def test_the_host_index_is_the_masks_nonzero(layout):
    samples = with_holes(shard_samples(episode_groups(1)))
    mb = {
        "packed": lambda: packed(samples),
        "packed_rows": lambda: packed(samples, 64),
        "padded": lambda: padded(samples),
        "shared": lambda: shared(samples, 0, True),
        "shared_padded": lambda: shared(samples, 0, False),
    }[layout]()
    assert mb.loss_index is not None
    expected = flat_index(mb.loss_mask != 0)
    assert mb.loss_index.tolist() == expected.tolist()
    assert 0 < len(expected) < sum(s.completion_len for s in samples)  # the holes and the left-out count
    assert mb.head_index().tolist() == expected.tolist()
    assert mb.span_index().tolist() == flat_index(mb.span_positions()).tolist()


def test_without_a_prebuilt_index_the_mask_gives_it():
    mb = dataclasses.replace(packed(with_holes(shard_samples(episode_groups(1)))), loss_index=None)
    assert mb.head_index().tolist() == flat_index(mb.loss_mask != 0).tolist()
