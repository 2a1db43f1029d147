"""PyTorch learner rank: HF causal LM, DDP over gloo (CPU), GRPO + PPO-clip with truncated IS, AdamW."""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from async_rl.cluster.placement import pin_current_process
from async_rl.cluster.resources import free_port
from async_rl.learner.algorithms import grpo_advantages, ppo_clip_loss, token_logprobs
from async_rl.learner.base import LearnerRank, LearnerSettings, Probe, StepMetrics
from async_rl.learner.batch_client import BatchClient
from async_rl.protocol import TrajectoryGroup
from async_rl.weight_sync.base import UpdateReceipt, WeightGroupInfo, WeightSender
from async_rl.weight_sync.bucketing import Manifest, build_manifest, to_dtype
from async_rl.weight_sync.checksum import ParamChecksum, checksum_of
from async_rl.weight_sync.shm import ShmChannel
from async_rl.weight_sync.transport import join_sender, open_membership


class Collated:
    """A shard as padded tensors. Loss positions index the *targets* (input shifted by one)."""

    def __init__(self, groups: list[TrajectoryGroup]) -> None:
        seqs, behav, starts, lengths = [], [], [], []
        for g in groups:
            for comp, lp in zip(g.completions, g.logprobs, strict=True):
                seqs.append(np.concatenate([g.prompt_tokens, comp]))
                behav.append(lp)
                starts.append(len(g.prompt_tokens) - 1)
                lengths.append(len(comp))
        width = max(len(s) for s in seqs)
        n = len(seqs)
        self.input_ids = torch.zeros(n, width, dtype=torch.long)
        self.attention_mask = torch.zeros(n, width, dtype=torch.long)
        self.behav_logp = torch.zeros(n, width - 1)
        self.loss_mask = torch.zeros(n, width - 1)
        for i, (s, lp, start, length) in enumerate(zip(seqs, behav, starts, lengths, strict=True)):
            self.input_ids[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
            self.attention_mask[i, : len(s)] = 1
            self.behav_logp[i, start : start + length] = torch.from_numpy(np.array(lp, dtype=np.float32))
            self.loss_mask[i, start : start + length] = 1
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        self.rewards = rewards
        self.advantages = grpo_advantages(rewards).reshape(-1, 1)
        self.seqs = seqs
        self.tokens = int(sum(lengths))


class TorchLearnerRank(LearnerRank):
    def __init__(self, settings: LearnerSettings, rank: int, world_size: int, master: str, cores: list[int]) -> None:
        pin_current_process(cores)
        self.s = settings
        self.rank = rank
        self.world_size = world_size
        self.master = master
        self._store: dist.TCPStore | None = None
        self._sender: WeightSender | None = None
        self._weight_info: WeightGroupInfo | None = None
        self._weight_generation = 0
        self._manifest: Manifest | None = None

    def rendezvous_address(self) -> str:
        self.master = f"127.0.0.1:{free_port()}"
        return self.master

    def setup(self) -> int:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(self.s.seed)
        host, port = self.master.rsplit(":", 1)
        if self.world_size > 1:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{host}:{port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=300),
            )
        dtype = getattr(torch, self.s.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(self.s.model_dir, dtype=dtype)
        self.model.train()
        self.ddp = (
            torch.nn.parallel.DistributedDataParallel(self.model) if self.world_size > 1 else self.model
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.s.lr, weight_decay=self.s.weight_decay, betas=(0.9, 0.99)
        )
        self.batches = BatchClient(self.s.buffer_address, self.s.run_id, self.rank, self.world_size, self.s.curve)
        return sum(p.numel() for p in self.model.parameters())

    def train_step(self, step: int) -> StepMetrics:
        t0 = time.perf_counter()
        groups = self.batches.fetch(step, self.s.batch_timeout_s)
        t1 = time.perf_counter()
        b = Collated(groups)
        self._last_batch = b
        logits = self.ddp(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
        logp = token_logprobs(logits, b.input_ids[:, 1:], self.s.temperature)
        loss, stats = ppo_clip_loss(
            logp, b.behav_logp, b.advantages, b.loss_mask, self.s.clip_eps_low, self.s.clip_eps_high, self.s.tis_cap
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.max_grad_norm)
        self.optimizer.step()
        return StepMetrics(
            step=step,
            rank=self.rank,
            loss=stats.loss,
            reward_mean=float(b.rewards.mean()),
            kl_behav=stats.kl_behav,
            logprob_abs_diff=stats.logprob_abs_diff,
            grad_norm=float(grad_norm),
            clip_frac=stats.clip_frac,
            tis_frac=stats.tis_frac,
            samples=int(b.input_ids.shape[0]),
            tokens=b.tokens,
            wait_s=t1 - t0,
            compute_s=time.perf_counter() - t1,
        )

    def probe_logprobs(self, max_samples: int) -> Probe:
        """Log-probs of the current weights on completion tokens of the last batch (temperature 1, the
        same convention as vLLM's prompt log-probs): compared with a generator scoring the same tokens."""
        b = self._last_batch
        n = min(max_samples, len(b.seqs))
        with torch.no_grad():
            logits = self.model(input_ids=b.input_ids[:n], attention_mask=b.attention_mask[:n]).logits[:, :-1]
            logp = token_logprobs(logits, b.input_ids[:n, 1:])
        token_ids, positions, values = [], [], []
        for i in range(n):
            cols = b.loss_mask[i].nonzero().flatten().tolist()
            token_ids.append(b.seqs[i].tolist())
            positions.append([c + 1 for c in cols])  # index of the scored token in the sequence
            values.append(logp[i, cols].tolist())
        return Probe(token_ids=token_ids, positions=positions, logprobs=values)

    # ---- weight sync (rank 0) -------------------------------------------------------------------

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        # named_parameters() lists a tied weight once, under its first name: what vLLM's loader expects.
        return dict(self.model.named_parameters())

    def weight_manifest(self) -> Manifest:
        if self._manifest is None:
            wire = to_dtype(self.s.wire_dtype) if self.s.wire_dtype else None
            self._manifest = build_manifest(self._named_tensors().items(), self.s.bucket_mb << 20, wire)
        return self._manifest

    def open_weight_group(self, world_size: int) -> WeightGroupInfo:
        self._sender = None
        self._weight_generation += 1
        self._weight_info, self._store = open_membership(
            self.s.weight_sync_host,
            self.s.weight_sync_port,
            world_size,
            self.s.weight_sync_timeout_s,
            self.s.weight_sync_backend,
            self.weight_manifest(),
            self.s.weight_checksum,
            self._weight_generation,
            store=self._store,
        )
        return self._weight_info

    def join_weight_group(self) -> None:
        self._sender = join_sender(self._weight_info, self._store, self.weight_manifest())

    def broadcast_weights(self, version: int) -> UpdateReceipt:
        if self._sender is None:
            raise RuntimeError("broadcast_weights before join_weight_group")
        with torch.no_grad():
            return self._sender.send(self._named_tensors(), version)

    def param_checksum(self) -> ParamChecksum:
        return checksum_of(self._named_tensors().values())

    def shutdown(self) -> None:
        if self._weight_info is not None and self._weight_info.shm_path:
            ShmChannel.unlink(self._weight_info.shm_path)  # opened but never joined
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
