"""Body of one FSDP2 learner rank for test_learner_fsdp2 (spawned: must be importable)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from async_rl.learner.driver import LearnerDriver
from tests.unit._learner_fixtures import groups, settings


def run_rank(rank: int, world: int, master: str, model_dir: str, out: str) -> None:
    s = settings(model_dir, parallel="fsdp2", micro_batch_size=2 + rank)  # ranks differ in micro-batch count
    learner = LearnerDriver(s, rank, world, master, [])
    learner.setup()
    metrics = [learner.train_on_shard(k, groups(20 + k)) for k in range(2)]
    # A recovery sync during a step must not start the gather collective (a peer may be in the step's
    # own collectives): not gathered since the optimizer step, so each rank declines on its own.
    # (train_on_shard leaves the driver's version at 0; train_step would set it.)
    declined = learner.gather_weights(0, during_step=True)
    gathered = learner.gather_weights(0)  # between steps: the collective gather
    after_gather = learner.gather_weights(0, during_step=True)  # now readable without a collective
    ckpt = Path(out) / "ckpt"
    if rank == 0:
        ckpt.mkdir()
    torch.distributed.barrier()
    learner.save_checkpoint(str(ckpt))
    learner.gather_weights()
    saved = {n: t.clone() for n, t in learner.hf_weights().items()} if rank == 0 else {}
    checksum = learner.param_checksum() if rank == 0 else None
    learner.shutdown()

    # A fresh FSDP2 group restores the checkpoint and holds the same full weights.
    fresh = LearnerDriver(s, rank, world, master.rsplit(":", 1)[0] + ":" + str(int(master.rsplit(":", 1)[1]) + 1), [])
    fresh.setup()
    step = fresh.load_checkpoint(str(ckpt))
    fresh.gather_weights()
    if rank == 0:
        restored = fresh.hf_weights()
        same = all(torch.equal(saved[n], restored[n]) for n in saved)
        (Path(out) / "rank0.json").write_text(
            json.dumps(
                {
                    "step": step,
                    "during_step": [declined, gathered, after_gather],
                    "same_after_load": same,
                    "names": sorted(saved),
                    "checksum": [checksum.total, checksum.sum_sq, checksum.count],
                    "loss": [m.loss for m in metrics],
                    "micro_batches": [m.micro_batches for m in metrics],
                }
            )
        )
    fresh.shutdown()
