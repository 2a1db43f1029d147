"""With a KL penalty, the reference is the run's initial weights, also after `--resume` (which starts
the learner from the checkpoint's weights): the anchor must not move at every resume."""

from __future__ import annotations

import time

import torch

from async_rl.buffer.actor import BufferState
from async_rl.buffer.ledger import Accounts
from async_rl.cluster.placement import plan_placement
from async_rl.config import load_config
from async_rl.control import checkpoint
from async_rl.control.controller import Controller
from async_rl.learner.driver import LearnerDriver
from async_rl.learner.hf_io import read_hf_weights
from async_rl.models.tiny import resolve_model_path
from tests.unit._learner_fixtures import groups


def test_resumed_run_keeps_the_initial_weights_as_kl_reference(tmp_path):
    model_dir = resolve_model_path("tiny-qwen2", str(tmp_path / "models"))
    cfg = load_config(None, [f"model.path={model_dir}", "algorithm.kl_coef=0.1", "learner.lr=0.01"])
    plan = plan_placement(cfg, [0, 1])
    run_dir = tmp_path / "run"

    def learner(c: Controller) -> LearnerDriver:
        rank = LearnerDriver(c.learner_spec("tcp://127.0.0.1:2"), 0, 1, "", [])
        rank.setup()
        return rank

    first_controller = Controller(cfg, model_dir, run_dir, plan)
    first = learner(first_controller)
    for k in range(2):
        first.train_on_shard(k, groups(k))
    tmp = checkpoint.begin(run_dir)
    first.save_checkpoint(str(tmp))
    state = checkpoint.RunCheckpoint(
        step=2, version=2, saved_at=time.time(), initial_model_dir=str(first_controller.initial_model_dir),
        buffer=BufferState(accounts=Accounts(), generator_version=2, prompts_drawn=0, rejected_frames={},
                           reward_errors=0, reward_timeouts=0),
    )
    ckpt = checkpoint.commit(tmp, state, keep=2)
    first.shutdown()

    # The resumed launch may name another model path: the checkpoint's record is what counts.
    resumed = learner(Controller(cfg, tmp_path / "elsewhere", run_dir, plan, resume_from=ckpt))
    assert resumed.load_checkpoint(str(ckpt)) == 2
    initial = read_hf_weights(model_dir)
    trained = read_hf_weights(ckpt / "model")
    reference = dict(resumed.algo.reference.model.named_parameters())
    assert any(not torch.equal(trained[n], initial[n]) for n in initial)  # the checkpoint moved
    for name, w in initial.items():
        torch.testing.assert_close(reference[name], w, atol=0, rtol=0, msg=name)
    resumed.shutdown()
