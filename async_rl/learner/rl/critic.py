"""PPO's critic: a small value head on the policy's last hidden states, with its own optimizer.

The head reads the hidden states *detached* from the policy: the value loss never moves the policy
weights (so what is broadcast to vLLM and saved as the HF model is the policy alone), and the critic
is a few thousand parameters instead of a second copy of the model. It is trained on the same batch,
before the policy step, from the values it predicted before its own update (standard PPO).

The head and its optimizer live on the learner's device (the backend's own): its gradient
all-reduce then runs on device tensors, which an NCCL group requires (CPU tensors over NCCL raise).
Inputs may come from anywhere (the driver's prepare holds them on the CPU); outputs go back there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from async_rl.learner.rl.losses import value_loss_sum


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, width: int, seed: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(hidden_size, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
        )
        # Same initial weights on every data-parallel rank, independent of the global RNG's history.
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
            self.net[-1].weight.zero_()  # V = bias = 0 at the start: advantages start as plain returns
            self.net[-1].bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [B, T]"""
        return self.net(hidden.float()).squeeze(-1)


class Critic:
    def __init__(
        self, hidden_size: int, width: int, lr: float, seed: int, max_grad_norm: float,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.head = ValueHead(hidden_size, width, seed).to(self.device)  # initialised on the CPU generator
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=lr)
        self.max_grad_norm = max_grad_norm

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.head(hidden.to(self.device)).to(hidden.device)

    def update(self, hidden: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
        """One optimizer step on 0.5 * (V - R)^2, the mean over the loss tokens of every data-parallel
        rank (not the mean of per-rank means: ranks hold different token counts); returns that loss
        before the step. SP ranks of a group hold the same tokens, which counts them in the sum and in
        the token total alike, so the mean is the same."""
        d = self.device
        mask = mask.to(d, torch.float32)
        sq = value_loss_sum(self.head(hidden.detach().to(d)), returns.to(d), mask)
        totals = torch.stack([sq.detach(), mask.sum()])
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            dist.all_reduce(totals)
        tokens = totals[1].clamp(min=1.0)
        self.optimizer.zero_grad(set_to_none=True)
        (sq / tokens).backward()  # this rank's part of the global mean's gradient
        if distributed:
            for p in self.head.parameters():
                dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return float(totals[0] / tokens)

    def state_dict(self) -> dict:
        return {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])  # copies into the head's own device
        self.optimizer.load_state_dict(state["optimizer"])
