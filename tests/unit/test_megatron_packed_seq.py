"""How the Megatron backend hands a packed micro-batch to Transformer Engine: the sequence
boundaries of its rows flattened into one row (cu_seqlens), not a mask. Runs without megatron-core
except the last test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.learner.batch import packing
from async_rl.learner.megatron.backend import cu_seqlens, packed_bounds, pad_to


def _samples(lengths: list[int]) -> list[packing.SeqSample]:
    return [
        packing.SeqSample(
            tokens=np.arange(3, 3 + n, dtype=np.int64), start=n - 1,
            behav_logp=np.zeros(1, dtype=np.float32), advantages=np.ones(1, dtype=np.float32),
        )
        for n in lengths
    ]


def test_cu_seqlens_of_a_known_packing():
    # rows of 8 by first fit: row 0 = [5, 3], row 1 = [4, 2] (tail of 2), row 2 = [6] (tail of 2)
    mb = packing.packed(_samples([5, 4, 3, 6, 2]), row_tokens=8)
    assert mb.input_ids.shape == (3, 8)
    bounds, longest = cu_seqlens(mb.position_ids)
    assert bounds.dtype == torch.int32
    # a row's unused tail stays with its last sequence: 2 + 2 tokens in row 1, 6 + 2 in row 2
    assert bounds.tolist() == [0, 5, 8, 12, 16, 24]
    assert longest == 8


def test_rows_added_for_the_pipeline_start_sequences_of_their_own():
    mb = pad_to(packing.packed(_samples([3, 2]), row_tokens=5), rows=2, cols=6)
    bounds, longest = cu_seqlens(mb.position_ids)
    assert bounds.tolist() == [0, 3, 6, 12]  # row 0: 3, then 2 + 1 grown column; row 1: all new
    assert longest == 6


def test_a_batch_that_does_not_start_a_sequence_is_refused():
    with pytest.raises(ValueError, match="first position id must be 0"):
        cu_seqlens(torch.tensor([[1, 2, 0, 1]]))


def test_thd_params_are_megatrons_packed_sequence_format():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")
    from megatron.core.packed_seq_params import PackedSeqParams

    from async_rl.learner.megatron.backend import thd_params

    mb = packing.packed(_samples([5, 4, 3, 6, 2]), row_tokens=8)
    p = thd_params(mb, torch.device("cpu"))
    assert isinstance(p, PackedSeqParams) and p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 5, 8, 12, 16, 24]
    assert p.max_seqlen_q == p.max_seqlen_kv == 8


def _host_mask(position_ids: torch.Tensor | None, rows: int, cols: int) -> torch.Tensor:
    """The rule by plain loops: causal, and within a row only inside one sequence (a sequence starts
    where its position id is 0). True = masked."""
    out = torch.ones(rows, 1, cols, cols, dtype=torch.bool)
    for r in range(rows):
        seq = [0] * cols
        for c in range(cols):
            seq[c] = seq[c - 1] + (position_ids is not None and int(position_ids[r, c]) == 0) if c else 0
        for q in range(cols):
            for k in range(q + 1):
                out[r, 0, q, k] = seq[q] != seq[k]
    return out


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_the_device_built_mask_is_causal_within_each_sequence(pack):
    """`attention_mask` builds megatron's mask where the model runs, from the position ids alone (the
    former path built it on the host and copied rows x T x T booleans); the additive form SDPA reads."""
    from async_rl.learner.megatron.backend import additive, attention_mask

    mb = packing.micro_batches(_samples([5, 4, 3, 6, 2, 7]), pack=pack, row_tokens=9)[0]
    rows, cols = mb.input_ids.shape
    mask = attention_mask(rows, cols, mb.position_ids, torch.device("cpu"))
    assert torch.equal(mask, _host_mask(mb.position_ids, rows, cols))
    assert pack == (mb.position_ids is not None) and (not pack or rows < 6)  # packed rows hold several sequences
    bias = additive(mask, torch.float32)
    assert torch.equal(bias == float("-inf"), mask) and torch.equal(bias[~mask], torch.zeros(int((~mask).sum())))


def test_the_bounds_from_the_segment_table_equal_the_position_ids_ones():
    """THD's cu_seqlens read from the packing's segment table (no pass over the tokens) are the ones
    the position ids give; a micro-batch grown for the pipeline (no table) falls back to them."""
    for seed, row in [(0, 8), (1, 9), (2, 16)]:
        lengths = np.random.default_rng(seed).integers(2, row, size=7).tolist()
        for mb in packing.micro_batches(_samples(lengths), pack=True, max_seqs=4, row_tokens=row):
            assert mb.segments is not None
            bounds, longest = packed_bounds(mb)
            ref, ref_longest = cu_seqlens(mb.position_ids)
            assert torch.equal(bounds, ref) and bounds.dtype == torch.int32 and longest == ref_longest
    grown = pad_to(packing.packed(_samples([3, 2]), row_tokens=5), rows=2, cols=6)
    assert grown.segments is None and packed_bounds(grown)[0].tolist() == [0, 3, 6, 12]
