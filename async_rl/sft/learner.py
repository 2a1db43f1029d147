"""Supervised fine-tuning on the learner (train.mode=sft): the same driver, backends, packing and
checkpoints as RL, with the demonstrations read by every rank itself (no buffer, no engines) and the
negative log-likelihood of the assistant tokens as the loss.

Each step's conversations are a pure function of the step (sft/data.py: `step_indices`), so a run
resumed from a checkpoint at step N draws exactly the batches it would have drawn; each data-parallel
rank takes every dp_size-th of them. A demonstration is a group of one sample whose completion holds
the assistant's turns (and anything between them, masked), as a multi-turn episode's would."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import torch

from async_rl.learner.base import StepMetrics
from async_rl.learner.driver import LearnerDriver, shard_samples
from async_rl.learner.rl.algorithms import LOSS_STATS, Algorithm, Prepared, TokenBatch, data_parallel_sum
from async_rl.protocol import TrajectoryGroup
from async_rl.sft.data import ChatTokenizer, Demonstrations, as_group, load_demonstrations, step_indices


class SupervisedLoss(Algorithm):
    """The token mean, over the global batch's assistant tokens, of -log pi(token): in the algorithm's
    interface, so the driver's micro-batches, gradient sums and optimizer steps are RL's."""

    def prepare(self, b: TokenBatch, policy, reduce=data_parallel_sum) -> Prepared:
        mask = b.loss_mask
        ones = mask.clone()  # every assistant token counts (the signal of an optimizer step)
        denominator, signal = self._totals(mask, ones, False, reduce)
        return Prepared(
            behav_logp=b.behav_logp, mask=mask, advantages=ones, prox_logp=None, ref_logp=None,
            denominator=denominator, kl_ref=0.0, value_loss=0.0, signal=signal,
        )

    def loss_terms(
        self, p: Prepared, logp: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nll = -(logp * p.mask).sum() / torch.as_tensor(p.denominator).clamp(min=1.0)
        stats = torch.zeros(len(LOSS_STATS), dtype=torch.float32, device=logp.device)
        stats[LOSS_STATS.index("loss")] = stats[LOSS_STATS.index("policy_loss")] = nll.detach().float()
        return nll, stats


class SftEval(msgspec.Struct, frozen=True):
    """One rank's part of an evaluation: the NLL summed over its eval conversations' assistant tokens."""

    nll_sum: float
    tokens: int


class SftLearner(LearnerDriver):
    """A learner rank of a train.mode=sft run (driven by sft/runner.py)."""

    def setup(self) -> int:
        # The likelihood of the demonstrations is the model's own, at temperature 1: the driver scores
        # and trains at generators.temperature, which an RL config may have set otherwise.
        g = self.spec.generators
        self.spec = msgspec.structs.replace(self.spec, generators=msgspec.structs.replace(g, temperature=1.0))
        params = super().setup()
        s = self.spec
        self.algo = SupervisedLoss(
            s.algorithm, max_tokens=s.generators.max_tokens, temperature=1.0, model_dir=s.model_dir,
            dtype=getattr(torch, s.model.dtype), hidden_size=0, seed=s.train.seed, max_grad_norm=s.learner.max_grad_norm,
        )
        chat = ChatTokenizer(s.model_dir)
        limit = s.sft.max_length or s.generators.max_model_len
        self.demos = load_demonstrations(s.sft.train_files, s.sft.messages_key, chat, limit, "sft.train_files")
        self.eval_demos = load_demonstrations(s.sft.eval_files, s.sft.messages_key, chat, limit, "sft.eval_files")
        return params

    def data_summary(self) -> tuple[int, int, dict[str, int], int]:
        """(conversations, of them cut at the length limit, left out by reason, eval conversations)."""
        return len(self.demos), self.demos.cut, dict(self.demos.skipped), len(self.eval_demos)

    def _shard(self, demos: Demonstrations, indices: list[int]) -> list[TrajectoryGroup]:
        info = self.backend.info
        return [as_group(demos.items[i], i) for i in indices[info.dp_rank :: info.dp_size]]

    def sft_step(self, step: int) -> StepMetrics:
        """One optimizer step on step `step`'s conversations (this rank's share of them)."""
        s = self.spec
        t0 = time.perf_counter()
        groups = None
        if self.backend.info.fetches_batch:
            groups = self._shard(self.demos, step_indices(len(self.demos), s.sft.batch_size, step, s.train.seed, s.sft.shuffle))
        groups = self.backend.share_shard(groups)
        with self._weights_lock:
            metrics = self.train_on_shard(step, groups)
            self.version = step + 1
        metrics.wait_s = time.perf_counter() - t0 - metrics.compute_s
        return metrics

    def sft_eval(self) -> SftEval:
        """The eval conversations' NLL (this rank's every dp_size-th), with the weights now."""
        if not self.eval_demos.items:
            return SftEval(0.0, 0)
        groups = self._shard(self.eval_demos, list(range(len(self.eval_demos))))
        with self._weights_lock:
            scores = self._score(shard_samples(groups), 1.0)
        nll, tokens = 0.0, 0
        for g, lp in zip(groups, scores, strict=True):
            mask = g.loss_mask(0).astype(bool)
            nll -= float(np.asarray(lp, np.float64)[mask].sum())
            tokens += int(mask.sum())
        return SftEval(nll, tokens)
