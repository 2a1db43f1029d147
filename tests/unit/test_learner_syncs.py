"""Host reads per step: the loss statistics of a step's micro-batches are read once per step, so a
micro-batch adds no host sync: the chunked head gathers its loss positions by an index built on the
host from the packing plan (`MicroBatch.loss_index`), not by a `nonzero` on the device.

Counted on the CPU as a proxy for CUDA syncs: every Python-level read of a tensor's values (item,
tolist, float, int, bool, numpy; nested reads count once) and every op with a data-dependent shape
(nonzero, masked_select), during one `train_on_shard`. The proxy also counts reads of host tensors
(the shard's bookkeeping), which cost no sync on a GPU; those do not grow with the micro-batches, so
the test bounds the count's growth per micro-batch, not its total."""

from __future__ import annotations

from tests.unit._host_reads import HostReads
from tests.unit._learner_fixtures import groups, make_rank


def reads_per_step(model_dir, micro_batch_size: int) -> tuple[int, int]:
    rank = make_rank(model_dir, micro_batch_size=micro_batch_size, micro_batch_tokens=0)
    rank.train_on_shard(0, groups(0))
    with HostReads().counting() as reads:
        m = rank.train_on_shard(1, groups(1))
    return reads.count, m.micro_batches


def test_a_micro_batch_adds_no_host_read(model_dir):
    one, n_one = reads_per_step(model_dir, 0)
    many, n_many = reads_per_step(model_dir, 1)
    assert (n_one, n_many) == (1, 6)
    # Before the statistics stayed on the device: 12 more per micro-batch (7 policy-loss statistics,
    # the total, the entropy, the token count twice, the head's nonzero); before the head's index came
    # with the batch: one (the nonzero).
    assert many - one <= 0
    assert one > 0  # the proxy counts: the step's own reads (grad norm, the flags, the statistics)
