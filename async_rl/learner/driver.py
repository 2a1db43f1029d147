"""The learner rank the controller talks to: one code path for everything that is not the model.

`LearnerDriver` fetches this rank's shard from the buffer, runs the algorithm's `prepare` (advantages
and its no-grad passes) and `loss` (every algorithm), cuts the shard into packed or padded
micro-batches, normalises the loss by the global batch's token count, applies the LR schedule,
reports the step's metrics (entropy included), holds the weights lock, serves the weights for sync
(`WeightSource`) and writes its part of checkpoints. The model lives behind `backend.ModelBackend`
(`learner.backend`: torch now; a Megatron backend plugs in the same way).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from async_rl.cluster.net import node_ip
from async_rl.cluster.placement import pin_current_process
from async_rl.config.spec import LearnerSpec
from async_rl.errors import RunError
from async_rl.learner.backend import ModelBackend, TokenScores
from async_rl.learner.base import (
    LearnerRank,
    Probe,
    StepMetrics,
    across_updates_count,
    completion_lengths,
    env_token_count,
    episode_infos,
    episode_rewards,
    truncated_count,
)
from async_rl.learner.batch.cut import MicroBatchCut
from async_rl.learner.batch.packing import MicroBatch, SeqSample, dummy_micro_batch
from async_rl.learner.batch.padded import PaddedShard
from async_rl.learner.batch.routes import check_routes, unrouted_rows
from async_rl.learner.batch.token_budget import resolve_budget
from async_rl.learner.batch_client import BatchClient
from async_rl.learner.hf_io import rng_state, set_rng_state
from async_rl.learner.host_memory import set_malloc_mmap_threshold
from async_rl.learner.model.moe import MoeShape
from async_rl.learner.model.vision_inputs import VisionInputs
from async_rl.learner.moe_metrics import ProbeSums, RouterTally
from async_rl.learner.rendezvous import host_store
from async_rl.learner.rl.algorithms import LOSS_STATS, Algorithm, Prepared
from async_rl.learner.schedule import lr_factor
from async_rl.learner.weight_source import WeightSource
from async_rl.models.cost import TOKENS, CostModel
from async_rl.models.shape import ModelShape
from async_rl.protocol import TrajectoryGroup
from async_rl.weight_sync.base import UpdateReceipt, WeightGroupInfo
from async_rl.weight_sync.bucketing import Manifest
from async_rl.weight_sync.checksum import ParamChecksum, checksum_of

TRAINER_STATE = "trainer_state.pt"
# Loss statistics accumulated over micro-batches (token-weighted), in this order on the wire.
_ENTROPY = 7  # _STATS' index of the entropy (the one statistic the loss does not compute)
_STATS = ("loss", "clip_frac", "tis_frac", "kl_behav", "logprob_abs_diff", "masked_frac", "kl_ref", "entropy",
          "cov_frac")


def make_backend(
    spec: LearnerSpec, rank: int, world_size: int, master: str, rendezvous_store: dist.TCPStore | None = None
) -> ModelBackend:
    if spec.learner.backend == "torch":
        from async_rl.learner.torch_backend import TorchBackend

        return TorchBackend(spec.learner, spec.model.dtype, rank, world_size, master, rendezvous_store, spec.vision)
    if spec.learner.backend == "megatron":
        from async_rl.cluster.devices import device_of
        from async_rl.learner.megatron.backend import MegatronBackend

        m = spec.learner.megatron
        return MegatronBackend(
            rank=rank,
            world_size=world_size,
            master=master,
            rendezvous_store=rendezvous_store,
            tensor_parallel_size=m.tensor_parallel_size,
            pipeline_parallel_size=m.pipeline_parallel_size,
            dtype=spec.model.dtype,
            lr=spec.learner.lr,
            weight_decay=spec.learner.weight_decay,
            max_grad_norm=spec.learner.max_grad_norm,
            distributed_optimizer=m.distributed_optimizer,
            transformer_engine=m.transformer_engine,
            attention=m.attention,
            device=device_of(spec.learner.device),
            seed=spec.train.seed,
            logprob_chunk_tokens=spec.learner.logprob_chunk_tokens,
            head_kernel=spec.learner.head_kernel,
            keep_logits=spec.learner.logprob_keep_logits,
            activation_checkpointing=spec.learner.activation_checkpointing,
            micro_batch_tokens=spec.learner.micro_batch_tokens,
            row_tokens=spec.learner.pack_row_tokens or spec.generators.max_model_len,
            expert_parallel_size=m.expert_model_parallel_size,
            routing_replay=spec.learner.routing_replay,
            moe_aux_loss_coef=spec.learner.moe_aux_loss_coef,
        )
    raise RunError(f"learner.backend={spec.learner.backend} has no model backend for the learner driver yet")


def _per_token(t: torch.Tensor | None, row: int, col: int, n: int) -> np.ndarray | None:
    """Row `row`'s values at logit columns col..col+n of a [B, T] (or [B, 1] broadcast) tensor."""
    if t is None:
        return None
    if t.shape[1] == 1:
        return np.full(n, float(t[row, 0]), dtype=np.float32)
    return t[row, col : col + n].detach().float().cpu().numpy().copy()


def check_shard_routes(groups: list[TrajectoryGroup], moe: MoeShape | None) -> None:
    """An MoE shard's recorded routes against its tokens and the model, before anything lays them out: a
    RunError in one line naming the prompt and sample otherwise. A dense model ignores routes."""
    if moe is None:
        return
    for g in groups:
        if g.routes is None:
            continue
        if len(g.routes) != g.size:
            raise RunError(f"prompt {g.prompt_id} (engine {g.engine_id}): {len(g.routes)} routes for {g.size} samples")
        for i, (routes, comp) in enumerate(zip(g.routes, g.completions, strict=True)):
            try:
                where = f"prompt {g.prompt_id} (engine {g.engine_id}) sample {i}"
                check_routes(routes, len(g.prompt_tokens) + len(comp), moe.layers, moe.top_k, moe.experts, where)
            except ValueError as e:
                raise RunError(str(e)) from None


def shard_samples(
    groups: list[TrajectoryGroup], prepared: Prepared | None = None, moe: MoeShape | None = None,
    vision: VisionInputs | None = None,
) -> list[SeqSample]:
    """Sequences of a shard, row i of `prepared` being sequence i: with the algorithm's per-token
    advantages (and the proximal and reference log-probs when its loss needs them), or, without
    `prepared` (scoring only), zero advantages. `moe`: the model's routing, with which the samples carry
    their recorded routes; `vision`: a vision-language model's, with which they carry their images."""
    samples = []
    row = 0
    for g in groups:
        prompt = np.asarray(g.prompt_tokens, dtype=np.int64)
        for i, (comp, lp) in enumerate(zip(g.completions, g.logprobs, strict=True)):
            col, n = len(prompt) - 1, len(comp)
            p = prepared
            samples.append(
                SeqSample(
                    tokens=np.concatenate([prompt, np.asarray(comp, dtype=np.int64)]),
                    start=len(prompt),
                    behav_logp=np.asarray(lp, dtype=np.float32),
                    advantages=_per_token(p.advantages, row, col, n) if p else np.zeros(n, dtype=np.float32),
                    prox_logp=_per_token(p.prox_logp, row, col, n) if p else None,
                    ref_logp=_per_token(p.ref_logp, row, col, n) if p else None,
                    cov_select=_per_token(p.cov_select, row, col, n) if p else None,
                    in_loss=bool(p.mask[row].any()) if p else True,
                    loss_mask=g.loss_mask(i) if g.loss_masks is not None else None,
                    routes=g.routes[i] if moe is not None and g.routes is not None else None,
                    vision=vision.of_sample(g, i) if vision is not None else None,
                )
            )
            row += 1
    return samples


def check_lengths(groups: list[TrajectoryGroup], max_model_len: int) -> None:
    """A sample longer than generators.max_model_len (which the engines cannot have produced, and which
    the learner's budgets and sequence parallelism are not sized for) stops the step in one line."""
    for g in groups:
        for i, comp in enumerate(g.completions):
            n = len(g.prompt_tokens) + len(comp)
            if n > max_model_len:
                raise RunError(f"prompt {g.prompt_id}, sample {i}: {n} tokens (prompt + completion) is above "
                               f"generators.max_model_len={max_model_len}")


def minibatch_rows(groups: list[TrajectoryGroup], minibatches: int) -> list[slice]:
    """The shard's rows (one per completion, groups in order) cut into `minibatches` runs of whole
    groups, as even in groups as the count allows (a group's advantages are relative to its own
    samples: a cut through it would train on half a baseline). Every rank cuts its shard into the
    same count, so all take the same number of optimizer steps; a rank with fewer groups than that
    gets empty mini-batches (the buffer's shards are equal; config validation keeps count <= groups)."""
    bounds = np.cumsum([0] + [g.size for g in groups])
    cuts = np.linspace(0, len(groups), minibatches + 1).round().astype(int)
    return [slice(int(bounds[a]), int(bounds[b])) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


class UpdateStats(msgspec.Struct, kw_only=True):
    """One optimizer step of a batch (train.minibatches x train.epochs per batch): its loss statistics
    (this rank's, token-weighted over its part of the mini-batch) and what the step did."""

    loss: float
    clip_frac: float
    tis_frac: float
    kl_behav: float
    logprob_abs_diff: float
    masked_frac: float
    kl_ref: float
    entropy: float
    cov_frac: float
    grad_norm: float  # before clipping; 0 without signal (no step); not finite when skipped as such
    nonfinite: bool  # skipped: a non-finite loss or gradient norm on some rank
    micro_batches: int


def step_means(updates: list[UpdateStats]) -> dict:
    """The batch's StepMetrics fields from its updates: the means of the loss statistics and of the
    gradient norm over the updates that were not skipped as non-finite (all 0 when every one was:
    `nonfinite_steps` says so), the skipped count, and the forward/backward passes run."""
    kept = [u for u in updates if not u.nonfinite]
    out = {k: float(np.mean([getattr(u, k) for u in kept])) if kept else 0.0 for k in (*_STATS, "grad_norm")}
    out["nonfinite_steps"] = len(updates) - len(kept)
    out["updates"] = len(updates)
    out["micro_batches"] = sum(u.micro_batches for u in updates)
    return out


class LearnerDriver(LearnerRank):
    def __init__(
        self, spec: LearnerSpec, rank: int, world_size: int, master: str, cores: list[int], by_cost: bool = True
    ) -> None:
        """`by_cost` False: every pass cuts its micro-batches by tokens alone (a comparison for tests and
        benchmarks; the buffer then deals the ranks by tokens too)."""
        pin_current_process(cores)
        self.spec = spec
        self.by_cost = by_cost
        self.rank = rank
        self.world_size = world_size
        self.master = master
        self._rendezvous_store: dist.TCPStore | None = None  # rank 0's, once rendezvous_address made it
        self.share_prompt = False  # learner.share_prompt where the backend supports it (setup)
        self.backend: ModelBackend | None = None  # made in setup, once the rendezvous address is known
        self.cut: MicroBatchCut | None = None  # how every pass cuts its micro-batches (setup: the budget, the cost)
        self.weights: WeightSource | None = None
        self.step_count = 0
        self.version = 0  # the policy version these weights are (step + 1 after train_step(step))
        self._last_samples: list[SeqSample] = []
        self.last_updates: list[UpdateStats] = []  # the last batch's optimizer steps, in order
        self._nonfinite_in_a_row = 0  # optimizer steps skipped for a non-finite loss or gradient, in a row
        self.batches: BatchClient | None = None
        # The actor runs two calls at once (a weight sync or a buffer redirect while train_step waits
        # for its batch); the weights change only under this lock, so a sync never sends a mix.
        self._weights_lock = threading.Lock()
        self._shut_down = threading.Event()  # ends a pending `watch`

    def rendezvous_address(self) -> str:
        host = node_ip()  # other ranks may run on other nodes (in a Ray actor: Ray's address of this node)
        self._rendezvous_store = host_store(host, self.world_size)  # bound now: no port to lose meanwhile
        self.master = f"{host}:{self._rendezvous_store.port}"
        return self.master

    def setup(self) -> int:
        s = self.spec
        random.seed(s.train.seed)
        np.random.seed(s.train.seed)
        torch.manual_seed(s.train.seed)
        if s.train.deterministic and s.learner.device == "cuda":
            # cuBLAS needs a fixed workspace for repeatable results (PyTorch's reproducibility notes);
            # on CPU torch's kernels already repeat at a fixed thread count (measured: test_determinism.py)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        set_malloc_mmap_threshold(s.learner.malloc_mmap_threshold_kb)  # a memory switch, off by default
        self.backend = make_backend(s, self.rank, self.world_size, self.master, self._rendezvous_store)
        params = self.backend.setup(s.model_dir)
        self.device = self.backend.device
        # One prompt per group where the backend takes the block masks it needs (not megatron's).
        self.share_prompt = s.learner.share_prompt and self.backend.takes_block_masks
        if s.learner.share_prompt and not self.share_prompt and self.rank == 0:
            print(f"[learner] learner.share_prompt: learner.backend={s.learner.backend} takes no block attention "
                  "mask; every sample carries its prompt", file=sys.stderr, flush=True)
        self.weights = WeightSource(s.weight_sync, self._named_tensors, adopt=self.backend.weights_are_live,
                                    served=self.backend.served_weights)
        from transformers import AutoConfig

        # a vision-language model's language model sets the budgets and costs (its images are not counted)
        model_config = AutoConfig.from_pretrained(s.model_dir).get_text_config()
        hidden_size = int(model_config.hidden_size) if s.algorithm.name == "ppo" else 0
        budget = resolve_budget(
            s.learner.micro_batch_tokens, device=self.device, config=model_config, trainable_params=params,
            compute_bytes=self._compute_bytes(), checkpointing=s.learner.activation_checkpointing,
            chunk=s.learner.logprob_chunk_tokens, keeps_logits=self.backend.keeps_logits,
            sequence_parallel=s.learner.sequence_parallel_size,
        )
        self.micro_batch_tokens = budget.tokens
        # what a micro-batch costs on the attention path that runs (models/cost.py): the buffer deals the
        # ranks by it (sent with each batch request) and every pass cuts its micro-batches by it (batch/cut.py)
        try:
            weight = ModelShape.of(model_config).attention_weight()
        except ValueError:
            weight = 0.0  # not a Llama/Qwen2-style decoder: tokens and padding alone
        cost = CostModel(attention_weight=weight, path=self.backend.attention_path, row_tokens=s.learner.pack_row_tokens)
        c = s.learner
        self.cut = MicroBatchCut(
            cost=cost if self.by_cost else None, pack=c.packing, max_seqs=c.micro_batch_size,
            max_tokens=self.micro_batch_tokens, row_tokens=c.pack_row_tokens, share_prompt=self.share_prompt,
        )
        if s.learner.micro_batch_tokens == "auto" and self.rank == 0:
            print(f"[learner] {budget.line}", file=sys.stderr, flush=True)
        # The KL reference runs whole sequences (not split over an SP group): its micro-batches get one rank's
        # share of the budget, cut as every pass's are, and the SP group's ranks share them (reference.RowShare).
        whole = self.cut.with_max_tokens(self.micro_batch_tokens // s.learner.sequence_parallel_size)
        self.algo = Algorithm(
            s.algorithm,
            max_tokens=s.generators.max_tokens,
            temperature=s.generators.temperature,
            model_dir=s.reference_model_dir,
            dtype=getattr(torch, s.model.dtype),
            hidden_size=hidden_size,
            seed=s.train.seed,
            max_grad_norm=s.learner.max_grad_norm,
            device=self.device,  # the reference model and the critic live where the policy does
            cut=whole,
            logprob_chunk_tokens=s.learner.logprob_chunk_tokens,
            base_reference=self.backend.base_reference(whole, s.learner.logprob_chunk_tokens, self.backend.head_kernel),
            head_kernel=self.backend.head_kernel,
            routing_replay=self.backend.replays_routes,
            reference_share=self.backend.reference_share(),
        )
        return params

    def _compute_bytes(self) -> int:
        """Bytes per activation element: 2 where the learner computes in bf16 (mixed_precision on CUDA,
        or set), else the model dtype's."""
        c = self.spec.learner
        if c.mixed_precision in ("bf16", "bf16_params") or (c.mixed_precision == "auto" and self.device.type == "cuda"):
            return 2
        return getattr(torch, self.spec.model.dtype).itemsize

    def _batch_client(self) -> BatchClient | None:
        """The buffer connection of a fetching rank, opened at its first fetch (a rank driven only
        through `train_on_shard` opens no socket)."""
        info = self.backend.info
        if self.batches is None and info.fetches_batch:
            s = self.spec
            cost = self.cut.cost or TOKENS
            self.batches = BatchClient(s.buffer_address, s.run_id, info.dp_rank, info.dp_size, s.curve, cost)
        return self.batches

    # ---- training --------------------------------------------------------------------------------

    def train_step(self, step: int) -> StepMetrics:
        t0 = time.perf_counter()
        client = self._batch_client()
        groups = client.fetch(step, self.spec.batch_timeout_s) if client is not None else None
        groups = self.backend.share_shard(groups)
        check_lengths(groups, self.spec.generators.max_model_len)
        wait_s = time.perf_counter() - t0
        with self._weights_lock:
            metrics = self.train_on_shard(step, groups)
            self.version = step + 1
        metrics.wait_s = wait_s
        return metrics

    def _dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.all_reduce(x, "sum")

    def _score_padded(
        self, groups: list[TrajectoryGroup], b: PaddedShard, with_hidden: bool, with_logp: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The current weights' no-grad log-probs [B, T] (None unless `with_logp`) and last hidden
        states [B, T, H] (when `with_hidden`) in the padded shard's layout, on the CPU like the shard,
        at its completion positions (0 elsewhere: the algorithm reads them under its loss mask).
        Computed over the shard's micro-batches (the learner's cut, `batch/cut.py`), like the training
        pass; without `with_logp` the backend may skip its output layer. Zeros on ranks without
        outputs (they compute no loss)."""
        logp = torch.zeros(b.loss_mask.shape)
        hidden = None
        i = 0  # the shard's row of the micro-batches' next sequence (they keep the shard's order)
        for mb in self._micro_batches(shard_samples(groups, moe=self.backend.moe, vision=self.backend.vision_inputs)):
            scores = self.backend.score(mb, self.spec.generators.temperature, hidden=with_hidden, head=with_logp)
            lp = h = None
            if scores is not None:
                lp = scores.logp.float().cpu() if with_logp and scores.logp is not None else None
                h = scores.hidden.float().cpu() if with_hidden and scores.hidden is not None else None
            for row, col, n in mb.spans:
                at = b.starts[i]
                if lp is not None:
                    logp[i, at : at + n] = lp[row, col : col + n]
                if h is not None:
                    if hidden is None:
                        hidden = torch.zeros(*b.loss_mask.shape, h.shape[-1])
                    hidden[i, at : at + n] = h[row, col : col + n]
                i += 1
        return (logp if with_logp else None), hidden

    def _micro_batches(self, samples: list[SeqSample]) -> list[MicroBatch]:
        """This rank's micro-batches, padded with empty ones to the most any rank has (at least one):
        every rank runs as many forward/backward passes, so the collectives inside them line up."""
        mbs = self.cut.micro_batches(samples)
        count = max(1, int(self.backend.all_reduce(torch.tensor([len(mbs)], device=self.device), "max").item()))
        return [mb.to(self.device) for mb in mbs] + [dummy_micro_batch().to(self.device)] * (count - len(mbs))

    def train_on_shard(self, step: int, groups: list[TrajectoryGroup]) -> StepMetrics:
        t0 = time.perf_counter()
        s = self.spec
        # The algorithm's no-grad passes and advantages run once on the shard as padded rows (the old
        # and proximal log-probs are the weights' before the batch's first update); the gradient
        # passes then run on packed micro-batches of each mini-batch, train.epochs times over.
        check_shard_routes(groups, self.backend.moe)
        # the shard's routes as padded rows: for the KL reference's replay only (the policy's passes take
        # them from the micro-batches)
        shard = PaddedShard(groups, with_routes=self.backend.replays_routes and self.algo.reference is not None)
        # The proximal log-probs only for the decoupled objective (ppo's behaviour objective wants
        # the hidden states alone: no output layer).
        decoupled = s.algorithm.objective == "decoupled"
        prepared = self.algo.prepare(
            shard, lambda h: self._score_padded(groups, shard, h, with_logp=decoupled or not h), self._dp_sum
        )
        samples = shard_samples(groups, prepared, self.backend.moe, self.backend.vision_inputs)
        self._last_samples = samples
        moe = self.backend.moe
        tally = RouterTally(moe, self.device) if moe is not None else None
        probe = self._routing_probe(samples) if moe is not None else None
        c = s.learner
        # The LR schedule counts batches, like the policy version: every update of a batch has its LR.
        lr = c.lr * lr_factor(self.step_count, c.lr_warmup_steps, s.train.total_steps, c.lr_decay, c.lr_min_ratio)
        cuts = minibatch_rows(groups, s.train.minibatches)
        parts = [prepared] if len(cuts) == 1 else [self.algo.minibatch(prepared, rows, self._dp_sum) for rows in cuts]
        updates: list[UpdateStats] = []
        for _ in range(s.train.epochs):
            for rows, part in zip(cuts, parts, strict=True):
                updates.append(self._update(step, len(updates), part, samples[rows], lr, tally))
        self.step_count += 1
        self.last_updates = updates
        counted = self.backend.info.counts_samples
        moe_metrics = None
        if tally is not None:
            unrouted = sum(unrouted_rows(x.routes, len(x.tokens)) for x in samples) if counted else 0
            moe_metrics = tally.metrics(self.backend.replays_routes, unrouted, probe, self._dp_sum)
        return StepMetrics(
            step=step,
            rank=self.rank,
            reward_mean=float(np.mean(episode_rewards(groups))),
            samples=sum(g.episode_count for g in groups) if counted else 0,
            tokens=sum(x.completion_len for x in samples) if counted else 0,
            wait_s=0.0,
            compute_s=time.perf_counter() - t0,
            lr=lr,
            value_loss=prepared.value_loss,
            completion_lens=completion_lengths(groups) if counted else [],
            truncated=truncated_count(groups) if counted else 0,
            episodes=episode_infos(groups) if counted else [],
            env_tokens=env_token_count(groups) if counted else 0,
            across_updates=across_updates_count(groups) if counted else 0,
            kl_teacher=prepared.kl_teacher,
            teacher_missing=shard.teacher_missing if counted and s.algorithm.name == "opd" else 0,
            moe=moe_metrics,
            **step_means(updates),
        )

    def _routing_probe(self, samples: list[SeqSample]) -> ProbeSums | None:
        """MoE: |learner - engine| log-prob sums on the first `learner.routing_probe_samples` samples of the
        shard (their model tokens), no gradient, with routing replay on and with the live router; None
        when the probe is off. Collective (every rank scores its own samples)."""
        count = self.spec.learner.routing_probe_samples
        if not count:
            return None
        probe = samples[:count]
        sums = []
        for replay in (True, False):
            diff = torch.zeros((), dtype=torch.float64, device=self.device)
            n = torch.zeros((), dtype=torch.float64, device=self.device)
            for mb in self._micro_batches(probe):
                scores = self.backend.score_routing(mb, self.spec.generators.temperature, replay)
                if scores is None or not mb.spans:
                    continue
                at = mb.span_positions() & (mb.loss_mask != 0)  # the model's tokens of the sequences
                diff += ((scores.logp - mb.behav_logp).abs() * at).sum().to(torch.float64)
                n += at.sum().to(torch.float64)
            sums += [diff, n]
        return tuple(float(x) for x in torch.stack(sums).cpu())

    def _update(
        self, step: int, index: int, prepared: Prepared, samples: list[SeqSample], lr: float,
        tally: RouterTally | None = None,
    ) -> UpdateStats:
        """One optimizer step on `samples` (this rank's part of a mini-batch): forward/backward over its
        micro-batches, then the step, unless the global mini-batch has no signal or its loss or
        gradient norm is not finite on some rank (every rank agrees: the flags are all-reduced)."""
        s = self.spec
        mbs = self._micro_batches(samples)
        # The statistics stay on the device until the step's end: one host read per step, not several
        # per micro-batch (each a sync on a GPU). The token counts are read once, here.
        tokens = torch.stack([mb.loss_mask.sum() for mb in mbs]).tolist()
        local_tokens = max(1.0, sum(tokens))
        acc = torch.zeros(len(_STATS), dtype=torch.float64, device=self.device)
        at = {name: i for i, name in enumerate(LOSS_STATS)}
        picks = torch.tensor([at[name] for name in _STATS if name != "entropy"], device=self.device)

        aux_coef = s.learner.moe_aux_loss_coef

        def loss_fn(i: int, scores: TokenScores) -> torch.Tensor:
            mb = mbs[i]
            loss, st = self.algo.loss_terms(prepared.for_micro_batch(mb), scores.logp, scores.entropy)
            if tally is not None and scores.router is not None and mb.spans:  # not a dummy micro-batch
                tally.add(scores.router)
                if aux_coef and scores.router.aux_loss is not None:
                    # its share of the batch's loss tokens, as the policy loss is normalised
                    loss = loss + aux_coef * scores.router.aux_loss * (tokens[i] / max(prepared.denominator, 1.0))
            share = tokens[i] / local_tokens  # statistics: token-weighted over this rank's part
            entropy = (scores.entropy.detach() * mb.loss_mask).sum() / max(1.0, tokens[i])
            values = st.index_select(0, picks).to(torch.float64)
            values = torch.cat([values[:_ENTROPY], entropy.reshape(1).to(torch.float64), values[_ENTROPY:]])
            values[1:] *= share  # the loss is its share of the global mean already; the rest are means here
            acc.add_(values)
            return loss

        self.backend.forward_backward(mbs, s.generators.temperature, loss_fn)
        if tally is not None and (whole := self.backend.router_stats()) is not None:
            tally.add(whole)
        stats = dict(zip(_STATS, self.backend.share_outputs(acc.cpu()).tolist(), strict=True))
        # This rank's loss is its share of the global token mean; the controller averages over ranks.
        stats["loss"] *= self.backend.info.dp_size
        grad_norm, nonfinite = 0.0, False
        if prepared.signal:
            bad_loss = torch.tensor([0.0 if math.isfinite(stats["loss"]) else 1.0], dtype=torch.float64)
            if float(self.backend.all_reduce(bad_loss, "max")[0]) > 0:
                self.backend.drop_gradients()
                grad_norm, nonfinite = math.nan, True
            else:
                grad_norm = self.backend.optimizer_step(lr, s.learner.max_grad_norm)
                nonfinite = not math.isfinite(grad_norm)  # the backend skipped the step on every rank
        else:
            # No signal in the whole mini-batch (every rank agrees: `signal` is global): the weights and
            # the optimizer state stay as they are; the batch still counts (version and LR schedule).
            self.backend.drop_gradients()  # zero, or NaN times a zero advantage: not for the next step
        self._nonfinite_in_a_row = self._nonfinite_in_a_row + 1 if nonfinite else 0
        limit = s.train.max_nonfinite_steps
        if nonfinite and limit and self._nonfinite_in_a_row >= limit:
            raise RunError(
                f"{self._nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or gradient norm "
                f"(the last: step {step + 1}, update {index + 1}) and were skipped, weights kept: lower "
                f"learner.lr or check the data (train.max_nonfinite_steps={limit})"
            )
        return UpdateStats(grad_norm=grad_norm, nonfinite=nonfinite, micro_batches=len(mbs), **stats)

    def _score(self, samples: list[SeqSample], temperature: float) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for mb in self._micro_batches(samples):
            scores = self.backend.score(mb, temperature)
            if scores is not None:
                out.extend(mb.per_sequence(scores.logp))
        return out

    def compute_logprobs(self, groups: list[TrajectoryGroup], temperature: float = 1.0) -> list[np.ndarray]:
        with self._weights_lock:
            check_shard_routes(groups, self.backend.moe)
            return self._score(shard_samples(groups, moe=self.backend.moe, vision=self.backend.vision_inputs), temperature)

    def probe_logprobs(self, max_samples: int) -> Probe:
        """Log-probs of the current weights on completion tokens of the last batch (temperature 1, the
        same convention as vLLM's prompt log-probs): compared with a generator scoring the same tokens.
        Scored with the live router: the engine scores the probe with its own live router on the same
        weights, so an MoE sample's recorded routes (the older policy's choices) are not replayed here."""
        samples = [dataclasses.replace(x, routes=None) for x in self._last_samples[:max_samples]]
        with self._weights_lock:
            values = self._score(samples, 1.0)
        # The model's tokens only: a multi-turn episode's environment tokens were never sampled.
        keep = [np.ones(x.completion_len, bool) if x.loss_mask is None else x.loss_mask.astype(bool) for x in samples]
        images = [list(x.vision.images) if x.vision is not None else [] for x in samples]
        return Probe(
            token_ids=[x.tokens.tolist() for x in samples],
            positions=[(x.start + np.flatnonzero(k)).tolist() for x, k in zip(samples, keep, strict=True)],
            logprobs=[v[k].tolist() for v, k in zip(values, keep, strict=True)],
            # the engine scores a vision-language sample with its images (its prompt's first x.start tokens)
            images=images if any(images) else [],
            # (an episode with images of its own: its tokens up to its last image's placeholders)
            prompt_lens=[(x.vision.span if x.vision is not None else 0) or x.start for x in samples] if any(images) else [],
        )

    # ---- weights under HF names ------------------------------------------------------------------

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        """What a weight sync sends: the adapter alone (learner.lora), else every weight that trains."""
        adapter = self.backend.adapter()
        return adapter.tensors if adapter is not None else self.backend.synced_weights()

    def gather_weights(self, version: int | None = None, during_step: bool = False) -> bool:
        # Under the weights lock: a recovery sync that lands during train_step waits for the step's
        # end instead of reading (or gathering) parameters in the middle of the optimizer step.
        with self._weights_lock:
            if version is not None and self.version > version:
                return False  # trained past it: no collective, the caller skips this sync
            if during_step and not self.backend.weights_gathered():
                # Gathering is a collective, and a peer rank may already be in the step's own
                # collectives: both would wait for ever. The sync after the step delivers.
                return False
            self.backend.gather_weights()
            return True

    def hf_weights(self) -> dict[str, torch.Tensor]:
        return self.backend.hf_weights()

    def weight_manifest(self) -> Manifest:
        return self.weights.manifest()

    def open_weight_group(self, world_size: int) -> WeightGroupInfo:
        return self.weights.open(world_size)

    def join_weight_group(self) -> None:
        self.weights.join()

    def broadcast_weights(self, version: int, full: bool = False) -> UpdateReceipt:
        """`full`: every byte, even where weight_sync.delta could send a delta (the fall-back)."""
        receipt = self.weights.broadcast(version, full)  # the caller pinned the weights (pin_weights)
        adapter = self.backend.adapter()
        if adapter is None:
            return receipt
        # The adapter's checksum as the engines must now serve it, from the parameters themselves (not
        # from the bytes sent): each engine's receipt carries what it reads back from vLLM's slot.
        return msgspec.structs.replace(receipt, served=self._served_checksum(adapter))

    def _served_checksum(self, adapter) -> ParamChecksum:
        from async_rl.learner.model.lora import served_tensors

        wire = getattr(torch, self.spec.weight_sync.wire_dtype) if self.spec.weight_sync.wire_dtype else None
        return checksum_of(served_tensors(adapter.tensors, adapter.config, wire))

    def pin_weights(self, version: int) -> bool:
        # Released by unpin_weights, from another call (possibly another thread): a plain Lock allows it.
        self._weights_lock.acquire()
        if self.version > version:  # trained past it
            self._weights_lock.release()
            return False
        return True

    def unpin_weights(self) -> None:
        if self._weights_lock.locked():
            self._weights_lock.release()

    def release_gpu_memory(self, drop_grads: bool = True) -> int:
        """Colocated placement, before the engines wake up on this GPU: see learner/gpu_memory.py."""
        from async_rl.learner import gpu_memory

        return gpu_memory.release(gpu_memory.optimizers_of(self.backend), drop_grads)

    def param_checksum(self) -> ParamChecksum:
        with self._weights_lock:
            adapter = self.backend.adapter()
            return self._served_checksum(adapter) if adapter is not None else self.weights.checksum()

    # ---- checkpoints -----------------------------------------------------------------------------

    def _barrier(self) -> None:
        self.backend.all_reduce(torch.zeros(1, device=self.device))

    def save_checkpoint(self, directory: str) -> None:
        d = Path(directory)
        self.backend.save(directory)
        if self.rank == 0:
            state = {
                "step": self.step_count,
                "algorithm": self.algo.state_dict(),  # ppo's critic (replicated: rank 0's is everyone's)
                "reference_model_dir": self.spec.reference_model_dir,
            }
            torch.save(state, d / TRAINER_STATE)
        torch.save(rng_state(), d / f"rng_rank{self.rank}.pt")
        self._barrier()

    def load_checkpoint(self, directory: str) -> int:
        d = Path(directory)
        self.backend.load(directory)
        # Our own file (Python objects): not an untrusted download.
        state = torch.load(d / TRAINER_STATE, map_location="cpu", weights_only=False)
        if state.get("algorithm"):
            self.algo.load_state_dict(state["algorithm"])
        self.step_count = int(state["step"])
        self.version = self.step_count
        rng_file = d / f"rng_rank{self.rank}.pt"
        if not rng_file.is_file():  # more ranks than when saved: start from rank 0's streams
            rng_file = d / "rng_rank0.pt"
        set_rng_state(torch.load(rng_file, weights_only=False))
        self._barrier()
        return self.step_count

    def redirect_buffer(self, address: str) -> None:
        client = self._batch_client()
        if client is not None:
            client.redirect(address)

    def watch(self) -> str:
        """Held pending by the controller (death_watch.py) on a thread of its own: Ray fails it the
        moment this rank's process dies, wherever the run's loop is. Returns only at shutdown."""
        self._shut_down.wait()
        return "shut down"

    def shutdown(self) -> None:
        self._shut_down.set()
        if self.weights is not None:
            self.weights.close()
        if self.batches is not None:
            self.batches.close()
            self.batches = None
        if self.backend is not None:
            self.backend.shutdown()
