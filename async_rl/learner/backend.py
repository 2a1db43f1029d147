"""The model backend: what a learner rank needs from the model itself, and nothing else.

`learner/driver.py` owns everything that is not the model (batch fetch, the algorithm's prepare and
loss, micro-batching and packing, the global token mean, metrics, the weights lock, the weight
source for sync, checkpoint bookkeeping, the LR schedule). A backend (`torch_backend.TorchBackend`:
HF model under DDP or FSDP2; a Megatron backend: GPTModel with TP/PP/DP) implements this class.

Conventions every method follows:

- *Collective*: called by the driver on every rank of the learner group at once, the same number of
  times in the same order (a backend may run process-group collectives inside). *Rank 0*: called on
  global rank 0 only.
- Inputs are `packing.MicroBatch` (packed or padded, CPU tensors; the backend moves them). Per-token
  outputs are aligned with `MicroBatch.targets`: column t scores `targets[:, t]`. Shapes [B, T] are
  the micro-batch's rows x columns; log-probs and entropies are float32 whatever the compute dtype.
- Gradient semantics: after `forward_backward` on every rank, the gradient the optimizer sees is the
  SUM over data-parallel ranks and micro-batches of d(loss)/d(params) of the losses `loss_fn`
  returned (a backend whose reduction averages over DP ranks scales by the DP size). The driver
  normalises the losses by the global batch's token count, so this sum is the global token mean.
- Parameters cross the boundary under Hugging Face names, full (unsharded), a tied output embedding
  listed once under the input embedding's name (what vLLM's loader and `from_pretrained` expect).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
import torch

from async_rl.learner.batch.cut import MicroBatchCut
from async_rl.learner.batch.packing import MicroBatch
from async_rl.learner.model.moe import MoeShape, RouterStats
from async_rl.learner.model.vision_inputs import VisionInputs
from async_rl.learner.rl.reference import RowShare
from async_rl.protocol import AttentionPath, TrajectoryGroup


class ParallelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where this rank sits in the learner group. Data parallel (DP) ranks train on different shards;
    model-parallel peers (TP/PP) of one DP rank see the same shard."""

    rank: int  # global rank in the learner group
    world_size: int
    dp_rank: int  # which shard of the batch this rank trains (BatchClient's rank)
    dp_size: int  # how many shards the batch is cut into (BatchClient's world size)
    fetches_batch: bool  # this rank asks the buffer for its shard (one per DP rank: TP 0 of stage 0)
    has_outputs: bool  # `forward_backward` calls `loss_fn` and `score` returns values here (last stage)
    counts_samples: bool  # report samples/tokens in metrics (one rank per DP rank, so sums count once)


@dataclass
class TokenScores:
    """A forward pass's per-token outputs for one micro-batch, aligned with its targets."""

    # float32 [B, T]: log p(targets) at the temperature; carries grad in forward_backward. A backend may
    # compute both at the positions that need them only (the loss mask in forward_backward, the
    # sequences' completion positions in `score`) and leave 0 elsewhere; None from `score(head=False)`.
    logp: torch.Tensor | None
    entropy: torch.Tensor | None  # float32 [B, T], detached: entropy of the full next-token distribution
    hidden: torch.Tensor | None = None  # [B, T, H] detached last hidden states (when asked; ppo's critic)
    router: RouterStats | None = None  # MoE models, gradient passes: the forward's routing statistics


@dataclass
class Adapter:
    """A LoRA adapter: its tensors under PEFT's saved names (the live parameters when replicated), and
    its adapter_config.json content."""

    tensors: dict[str, torch.Tensor]
    config: dict


# loss_fn(index of the micro-batch, its scores) -> scalar loss of that micro-batch (already normalised)
LossFn = Callable[[int, TokenScores], torch.Tensor]


class ModelBackend(abc.ABC):
    """One learner rank's model, optimizer and parallel layout."""

    info: ParallelInfo  # valid after `setup`
    device: torch.device  # where the driver puts its own tensors (reductions, the reference model)
    # learner.head_kernel as it runs (eager, compiled or triton; auto decided, valid after `setup`): the
    # driver's KL reference pass uses the same kernel.
    head_kernel: str = "eager"
    # learner.logprob_keep_logits as it runs: the chunked head keeps its logits for the backward (the
    # driver's auto token budget counts them).
    keeps_logits: bool = False
    # MoE models (a backend that routes them): the routing shape the samples' routes must match; None: dense,
    # or a backend that does not replay routes
    moe: MoeShape | None = None
    replays_routes: bool = False  # learner.routing_replay as it runs (an MoE model's recorded routes decide)
    # a vision-language model (a backend that trains one): turns a group's images into its samples'; None: text only
    vision_inputs: VisionInputs | None = None
    # the attention path its kernel runs, as the cost estimate knows it (models/cost.py), set by setup
    attention_path: AttentionPath = "flash"

    @property
    def takes_block_masks(self) -> bool:
        """Micro-batches may share a prompt per group (`shared_prefix.py`, `learner.share_prompt`): the
        backend's attention follows their segment table (or the 4D mask built from it)."""
        return False

    @property
    def weights_are_live(self) -> bool:
        """`hf_weights` returns the live parameter tensors themselves (same storage every call): the
        shm weight sender may then move them into its shared mapping and skip a packing copy."""
        return False

    @abc.abstractmethod
    def setup(self, model_dir: str) -> int:
        """Collective. Join the learner's process groups, build the model from the HF folder
        `model_dir` and its optimizer (AdamW/Adam, betas (0.9, 0.99), `learner.weight_decay`). Returns
        the parameter count of the whole model (not this rank's shard)."""

    @abc.abstractmethod
    def score(
        self, mb: MicroBatch, temperature: float, *, hidden: bool = False, head: bool = True
    ) -> TokenScores | None:
        """Collective, no gradient. The current weights' scores on `mb` at its sequences' completion
        positions (`hidden=True`: with the last hidden states, for ppo's critic; `head=False`: the
        hidden states are all the caller needs, the backend may skip its output layer and return
        logp/entropy None). None on ranks without outputs (`info.has_outputs` false)."""

    def score_routing(self, mb: MicroBatch, temperature: float, replay: bool) -> TokenScores | None:
        """MoE backends (`moe` set): `score` with routing replay on or off whatever the setting (the
        driver's mismatch probe: the engine's log-probs against the learner's, both ways)."""
        raise NotImplementedError(f"{type(self).__name__} does not route MoE models")

    @abc.abstractmethod
    def forward_backward(self, mbs: list[MicroBatch], temperature: float, loss_fn: LossFn) -> None:
        """Collective. For each micro-batch in order: forward, `loss_fn(i, scores)` (on output ranks
        only), backward; gradients accumulate (see the module's gradient semantics) and are reduced
        over data-parallel ranks once, after the last one. Every rank passes the same number of
        micro-batches (the driver pads with `packing.dummy_micro_batch()`, whose loss is 0)."""

    def router_stats(self) -> RouterStats | None:
        """MoE backends whose micro-batches' `TokenScores.router` cannot say it (megatron with several
        pipeline stages: a token's agreement needs every stage's layers): the routing statistics of the
        last `forward_backward` as a whole, the same on every model-parallel peer. None: they came per
        micro-batch, or the model is dense."""
        return None

    @abc.abstractmethod
    def optimizer_step(self, lr: float, max_grad_norm: float) -> float:
        """Collective. Set the learning rate to `lr`, clip the global gradient norm (over all ranks and
        shards) to `max_grad_norm`, step, zero the gradients. Returns the norm before clipping.

        A gradient that is not finite on any rank skips the step on every rank (the backend reduces
        that flag over the whole learner group): the gradients are dropped, the weights and the
        optimizer state stay bitwise as they are, and the returned norm is not finite."""

    @abc.abstractmethod
    def drop_gradients(self) -> None:
        """Discard the gradients `forward_backward` accumulated, without a step (the driver found a
        non-finite loss on some rank; every rank calls it). No collective."""

    @abc.abstractmethod
    def all_reduce(self, x: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        """Collective. `x` reduced over the data-parallel group (every rank gets the result; identity
        with one DP rank). Used for the global token count, batch-wide whitening, metric sums."""

    def share_shard(self, groups: list[TrajectoryGroup] | None) -> list[TrajectoryGroup]:
        """Collective. The shard fetched by this DP rank's fetcher, given to its model-parallel peers
        (`groups` is None where `info.fetches_batch` is false). Pure data parallel: `groups` itself."""
        assert groups is not None
        return groups

    def share_outputs(self, values: torch.Tensor) -> torch.Tensor:
        """Collective. Float64 [K] values computed on output ranks (loss statistics), given to every
        model-parallel peer (pipeline stages without outputs pass zeros). No pipeline: `values`."""
        return values

    # ---- weights under HF names -------------------------------------------------------------------

    def gather_weights(self) -> None:  # noqa: B027 - replicated backends have nothing to gather
        """Collective. Make the full parameters available to rank 0's `hf_weights` (a sharded backend
        all-gathers and converts here). Called before every weight sync, checksum and checkpoint;
        valid until the next `optimizer_step`."""

    def weights_gathered(self) -> bool:
        """`hf_weights` can be read without a collective (replicated, or gathered since the last
        optimizer step). A sync during a train step may only read weights then: peers in the step's
        collectives would never join a gather."""
        return True

    @abc.abstractmethod
    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Rank 0, after `gather_weights`: every parameter, full, under its HF name (tied once), the
        same names, shapes and dtypes every call (the sync manifest is built once)."""

    def synced_weights(self) -> dict[str, torch.Tensor]:
        """What a full-weight sync sends: `hf_weights`, less the weights that never train (a frozen vision
        tower: the engines hold them from the same folder). The served checksum still covers every weight."""
        return self.hf_weights()

    def served_weights(self) -> dict[str, torch.Tensor]:
        """What an engine holds after a sync, which the served checksum covers: `hf_weights`, less weights
        the model never uses and vLLM does not load (a LLaVA tower's layers past its feature layer)."""
        return self.hf_weights()

    def adapter(self) -> Adapter | None:
        """learner.lora, rank 0, after `gather_weights`: the adapter (what a weight sync sends instead
        of `hf_weights`). None: the backend trains every weight."""
        return None

    def base_reference(self, cut: MicroBatchCut, logprob_chunk_tokens: int, head_kernel: str = "eager"):
        """A `reference.ReferencePolicy` over the trained model's own frozen base (LoRA: the adapter
        disabled), or None: the driver loads the reference weights from the run's initial folder."""
        return None

    def reference_share(self) -> RowShare | None:
        """The other ranks that hold this rank's shard (its sequence-parallel group), with whom the KL
        reference pass shares the shard's micro-batches; None: this rank scores all of them."""
        return None

    # ---- checkpoints -------------------------------------------------------------------------------

    @abc.abstractmethod
    def save(self, directory: str) -> None:
        """Collective. Write into the existing `directory`: `model/` an HF folder (config, tokenizer
        files, safetensors under HF names) that `from_pretrained` and vLLM load directly (rank 0), and
        the optimizer state in whatever layout the backend reloads (per-rank files allowed). The
        driver writes its own state (step, algorithm, RNG) next to it."""

    @abc.abstractmethod
    def load(self, directory: str) -> None:
        """Collective, after `setup`. Restore the weights and optimizer state `save` wrote."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the process groups and anything else held outside the process."""
