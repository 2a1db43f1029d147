"""Global-batch statistics over a real 2-rank gloo group: REINFORCE++/PPO whitening uses the whole
batch's moments on every rank, and the PPO critic stays identical on both ranks after its steps, the
same as one process training it on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from async_rl.cluster.net import free_port
from async_rl.learner.rl.advantages import masked_whiten
from async_rl.learner.rl.algorithms import data_parallel_sum
from async_rl.learner.rl.critic import Critic

pytestmark = pytest.mark.integration

X = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0], [7.0, 9.0, 11.0, 13.0], [2.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
CRITIC_MASK = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])  # 5 tokens vs 8


def critic_steps(hidden: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> tuple[list[float], list]:
    critic = Critic(hidden_size=3, width=4, lr=0.1, seed=0, max_grad_norm=1.0)
    losses = [critic.update(hidden, returns, mask) for _ in range(3)]
    return losses, [p.detach().clone() for p in critic.head.parameters()]


def worker(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        rows = slice(2 * rank, 2 * rank + 2)  # each rank holds half of the batch
        out[f"whiten{rank}"] = masked_whiten(X[rows], MASK[rows], data_parallel_sum)
        out[f"value_loss{rank}"], out[f"critic{rank}"] = critic_steps(hidden_of(rank), X[rows], CRITIC_MASK[rows])
    finally:
        dist.destroy_process_group()


def hidden_of(rank: int) -> torch.Tensor:
    return torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(rank))  # different data on each rank


def test_whitening_and_critic_agree_across_ranks():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(free_port(), out), nprocs=2, join=True)
        result = dict(out)
    whole = masked_whiten(X, MASK)
    torch.testing.assert_close(torch.cat([result["whiten0"], result["whiten1"]]), whole)
    # the halves alone would have been normalised differently
    assert not torch.allclose(result["whiten0"], masked_whiten(X[:2], MASK[:2]))
    for a, b in zip(result["critic0"], result["critic1"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(p.abs().sum() > 0 for p in result["critic0"][-2:])  # the zero-initialised output layer moved
    # the two ranks (5 and 8 loss tokens) train the critic as one process does on the whole batch: the
    # mean over all 13 tokens, not the mean of the two ranks' means
    losses, whole_critic = critic_steps(torch.cat([hidden_of(0), hidden_of(1)]), X, CRITIC_MASK)
    assert result["value_loss0"] == pytest.approx(losses) and result["value_loss1"] == pytest.approx(losses)
    for a, b in zip(result["critic0"], whole_critic, strict=True):
        torch.testing.assert_close(a, b)
