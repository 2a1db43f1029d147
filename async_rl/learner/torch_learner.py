"""PyTorch learner rank: HF causal LM, DDP or FSDP2 (gloo on CPU, nccl on GPU), packed micro-batches
with gradient accumulation, GRPO + PPO-clip with truncated IS, AdamW with warmup and decay."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from async_rl.cluster.placement import pin_current_process
from async_rl.cluster.resources import advertised_host, free_port
from async_rl.errors import RunError
from async_rl.learner.algorithms import Algorithm, Prepared, token_logprobs
from async_rl.learner.base import (
    LearnerRank,
    LearnerSettings,
    Probe,
    StepMetrics,
    checkpoint_model_dir,
    completion_lengths,
    truncated_count,
)
from async_rl.learner.batch_client import BatchClient
from async_rl.learner.hf_io import (
    read_hf_weights,
    read_model_files,
    rng_state,
    set_rng_state,
    write_hf_folder,
)
from async_rl.learner.packing import MicroBatch, SeqSample, dummy_micro_batch, micro_batches
from async_rl.learner.padded import PaddedShard
from async_rl.learner.schedule import lr_factor
from async_rl.protocol import TrajectoryGroup
from async_rl.weight_sync.base import UpdateReceipt, WeightGroupInfo, WeightSender
from async_rl.weight_sync.bucketing import Manifest, build_manifest, to_dtype
from async_rl.weight_sync.checksum import ParamChecksum, checksum_of
from async_rl.weight_sync.shm import ShmChannel
from async_rl.weight_sync.transport import join_sender, open_membership

TRAINER_STATE = "trainer_state.pt"



def _per_token(t: torch.Tensor | None, row: int, col: int, n: int) -> np.ndarray | None:
    """Row `row`'s values at logit columns col..col+n of a [B, T] (or [B, 1] broadcast) tensor."""
    if t is None:
        return None
    if t.shape[1] == 1:
        return np.full(n, float(t[row, 0]), dtype=np.float32)
    return t[row, col : col + n].detach().float().cpu().numpy().copy()


def shard_samples(groups: list[TrajectoryGroup], prepared: Prepared) -> list[SeqSample]:
    """Sequences of a shard with the algorithm's per-token advantages (and the proximal and
    reference log-probs when its loss needs them), row i of `prepared` being sequence i."""
    samples = []
    row = 0
    for g in groups:
        prompt = np.asarray(g.prompt_tokens, dtype=np.int64)
        for comp, lp in zip(g.completions, g.logprobs, strict=True):
            col, n = len(prompt) - 1, len(comp)
            samples.append(
                SeqSample(
                    tokens=np.concatenate([prompt, np.asarray(comp, dtype=np.int64)]),
                    start=len(prompt),
                    behav_logp=np.asarray(lp, dtype=np.float32),
                    advantages=_per_token(prepared.advantages, row, col, n),
                    prox_logp=_per_token(prepared.prox_logp, row, col, n),
                    ref_logp=_per_token(prepared.ref_logp, row, col, n),
                    in_loss=bool(prepared.mask[row].any()),
                )
            )
            row += 1
    return samples


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one (HF names their class in `_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


class TorchLearnerRank(LearnerRank):
    def __init__(self, settings: LearnerSettings, rank: int, world_size: int, master: str, cores: list[int]) -> None:
        pin_current_process(cores)
        self.s = settings
        self.rank = rank
        self.world_size = world_size
        self.master = master
        self.step_count = 0
        self._store: dist.TCPStore | None = None
        self._sender: WeightSender | None = None
        self._weight_info: WeightGroupInfo | None = None
        self._weight_generation = 0
        self._manifest: Manifest | None = None
        self._full: dict[str, torch.Tensor] | None = None  # FSDP2: gathered full weights (rank 0)
        self._last_samples: list[SeqSample] = []
        self.batches: BatchClient | None = None
        # The actor runs two calls at once (a weight sync or a buffer redirect while train_step waits
        # for its batch); the weights change only under this lock, so a sync never sends a mix.
        self._weights_lock = threading.Lock()
        self.version = 0  # the policy version these weights are (step + 1 after train_step(step))

    def rendezvous_address(self) -> str:
        import ray

        host = ray.util.get_node_ip_address()  # other ranks may run on other nodes
        self.master = f"{host}:{free_port(host)}"
        return self.master

    # ---- setup -----------------------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        return self.s.parallel == "fsdp2"

    def setup(self) -> int:
        from transformers import AutoModelForCausalLM

        random.seed(self.s.seed)
        np.random.seed(self.s.seed)
        torch.manual_seed(self.s.seed)
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.world_size > 1 or self.sharded:  # FSDP2 needs a process group even for one rank
            host, port = self.master.rsplit(":", 1)
            dist.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo",
                init_method=f"tcp://{host}:{port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=300),
            )
        self.model = AutoModelForCausalLM.from_pretrained(self.s.model_dir, dtype=getattr(torch, self.s.dtype))
        self._model_files = read_model_files(Path(self.s.model_dir))  # config + tokenizer for checkpoints
        self.model.to(self.device).train()
        self._param_names = [name for name, _ in self.model.named_parameters()]
        compute = self._compute_dtype()
        self._autocast = None
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(self.device.type, (self.world_size,))
            policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else None
            kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
            layers = decoder_layers(self.model)
            if not layers:
                raise RunError("learner.parallel=fsdp2: the model names no decoder layer class (_no_split_modules)")
            for layer in layers:
                fully_shard(layer, **kwargs)
            fully_shard(self.model, **kwargs)
            self.wrapped = self.model
        else:
            self._autocast = compute
            if self.world_size > 1:
                ids = [self.device.index] if self.device.type == "cuda" else None
                self.wrapped = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
            else:
                self.wrapped = self.model
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.s.lr, weight_decay=self.s.weight_decay, betas=(0.9, 0.99)
        )
        s = self.s
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: lr_factor(k, s.lr_warmup_steps, s.total_steps, s.lr_decay, s.lr_min_ratio)
        )
        self.algo = Algorithm(
            self.s.algorithm,
            max_tokens=self.s.max_tokens,
            temperature=self.s.temperature,
            model_dir=self.s.model_dir,
            dtype=getattr(torch, self.s.dtype),
            hidden_size=self.model.config.hidden_size,
            seed=self.s.seed,
            max_grad_norm=self.s.max_grad_norm,
        )
        self.batches = BatchClient(self.s.buffer_address, self.s.run_id, self.rank, self.world_size, self.s.curve)
        return sum(p.numel() for p in self.model.parameters())

    def _compute_dtype(self) -> torch.dtype | None:
        """bf16 compute on CUDA (parameters and optimizer stay in `model.dtype`); none on CPU."""
        mode = self.s.mixed_precision
        if mode == "bf16" or (mode == "auto" and self.device.type == "cuda"):
            return torch.bfloat16
        return None

    # ---- training --------------------------------------------------------------------------------

    def train_step(self, step: int) -> StepMetrics:
        t0 = time.perf_counter()
        groups = self.batches.fetch(step, self.s.batch_timeout_s)
        wait_s = time.perf_counter() - t0
        with self._weights_lock:
            metrics = self.train_on_shard(step, groups)
            self.version = step + 1
        metrics.wait_s = wait_s
        return metrics

    def train_on_shard(self, step: int, groups: list[TrajectoryGroup]) -> StepMetrics:
        t0 = time.perf_counter()
        # The algorithm's no-grad passes (proximal/reference log-probs, critic) and its advantages run
        # on the shard as padded rows; the gradient passes then run on packed micro-batches.
        prepared = self.algo.prepare(PaddedShard(groups), self.model)
        samples = shard_samples(groups, prepared)
        self._last_samples = samples
        self._full = None  # gathered weights go stale with this step
        mbs = micro_batches(
            samples, self.s.packing, self.s.micro_batch_size, self.s.micro_batch_tokens, self.s.pack_row_tokens
        )
        count = self._agree_count(len(mbs))
        total_tokens = max(1, sum(mb.loss_tokens for mb in mbs))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        acc = {"loss": 0.0, "clip_frac": 0.0, "tis_frac": 0.0, "kl_behav": 0.0, "logprob_abs_diff": 0.0,
               "masked_frac": 0.0, "kl_ref": 0.0}
        for i in range(count):
            mb = (mbs[i] if i < len(mbs) else dummy_micro_batch()).to(self.device)
            weight = mb.loss_tokens / total_tokens  # this micro-batch's share of the shard's tokens
            with self._grad_sync(i == count - 1):
                logp = self._logprobs(mb, self.s.temperature)
                # The loss is normalised by the shard's denominator, so micro-batch losses add up to
                # the shard's loss: their gradients accumulate by summing.
                loss, stats = self.algo.loss(
                    Prepared(
                        behav_logp=mb.behav_logp,
                        mask=mb.loss_mask,
                        advantages=mb.advantages,
                        prox_logp=mb.prox_logp,
                        ref_logp=mb.ref_logp,
                        denominator=max(prepared.denominator, 1.0),
                        kl_ref=prepared.kl_ref,
                        value_loss=prepared.value_loss,
                    ),
                    logp,
                )
                loss.backward()
            acc["loss"] += stats.loss
            for key in ("clip_frac", "tis_frac", "kl_behav", "logprob_abs_diff", "masked_frac", "kl_ref"):
                acc[key] += weight * getattr(stats, key)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        return StepMetrics(
            step=step,
            rank=self.rank,
            reward_mean=float(np.mean([r for g in groups for r in g.rewards])),
            grad_norm=float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
            samples=len(samples),
            tokens=sum(s.completion_len for s in samples),
            wait_s=0.0,
            compute_s=time.perf_counter() - t0,
            lr=lr,
            micro_batches=len(mbs),
            value_loss=prepared.value_loss,
            completion_lens=completion_lengths(groups),
            truncated=truncated_count(groups),
            **acc,
        )

    def _logprobs(self, mb: MicroBatch, temperature: float) -> torch.Tensor:
        autocast = (
            torch.autocast(self.device.type, dtype=self._autocast) if self._autocast else contextlib.nullcontext()
        )
        with autocast:
            logits = self.wrapped(**mb.model_inputs(self.device)).logits
        return token_logprobs(logits, mb.targets, temperature)

    def _agree_count(self, mine: int) -> int:
        """The most micro-batches any rank has: every rank runs that many forward/backward passes, so
        the collectives inside them (FSDP all-gathers, the DDP all-reduce) line up."""
        if not dist.is_initialized() or self.world_size == 1:
            return mine
        t = torch.tensor([mine], device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _grad_sync(self, sync: bool):
        """Accumulate gradients locally except on the last micro-batch, which reduces them once."""
        if self.sharded:
            self.model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        if sync or self.wrapped is self.model:
            return contextlib.nullcontext()
        return self.wrapped.no_sync()

    def _score(self, samples: list[SeqSample], temperature: float) -> list[np.ndarray]:
        mbs = micro_batches(
            samples, self.s.packing, self.s.micro_batch_size, self.s.micro_batch_tokens, self.s.pack_row_tokens
        )
        out: list[np.ndarray] = []
        with torch.no_grad():
            for i in range(self._agree_count(len(mbs))):
                mb = mbs[i] if i < len(mbs) else dummy_micro_batch()
                logp = self._logprobs(mb.to(self.device), temperature)
                out.extend(mb.per_sequence(logp))
        return out

    def compute_logprobs(self, groups: list[TrajectoryGroup], temperature: float = 1.0) -> list[np.ndarray]:
        return self._score(shard_samples(groups), temperature)

    def probe_logprobs(self, max_samples: int) -> Probe:
        """Log-probs of the current weights on completion tokens of the last batch (temperature 1, the
        same convention as vLLM's prompt log-probs): compared with a generator scoring the same tokens."""
        samples = self._last_samples[:max_samples]
        with self._weights_lock:
            values = self._score(samples, 1.0)
        return Probe(
            token_ids=[s.tokens.tolist() for s in samples],
            positions=[list(range(s.start, len(s.tokens))) for s in samples],
            logprobs=[v.tolist() for v in values],
        )

    # ---- weights under HF names ------------------------------------------------------------------

    def gather_weights(self) -> None:
        if not self.sharded or self._full is not None:
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # CPU: only rank 0 keeps the gathered copy. CUDA: every rank does (the NCCL sender needs
        # device tensors), at the cost of one full copy of the weights per GPU during the sync.
        offload = self.device.type == "cpu"
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
        self._full = {name: full[name] for name in self._param_names} if full else {}

    def hf_weights(self) -> dict[str, torch.Tensor]:
        # named_parameters() lists a tied weight once, under its first name: what vLLM's loader expects.
        if not self.sharded:
            return dict(self.model.named_parameters())
        if self._full is None:
            raise RuntimeError("learner.parallel=fsdp2: hf_weights before gather_weights")
        return self._full

    def weight_manifest(self) -> Manifest:
        if self._manifest is None:
            wire = to_dtype(self.s.wire_dtype) if self.s.wire_dtype else None
            # Shapes and dtypes only: an FSDP2 parameter (DTensor) reports its full shape.
            self._manifest = build_manifest(self.model.named_parameters(), self.s.bucket_mb << 20, wire)
        return self._manifest

    def open_weight_group(self, world_size: int) -> WeightGroupInfo:
        self._sender = None
        self._weight_generation += 1
        self._weight_info, self._store = open_membership(
            advertised_host(self.s.weight_sync_host),
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
        if not self.sharded:
            # shm: the parameters move into the shared mapping, so an update needs no packing copy
            # (FSDP2 gathers fresh full tensors for every sync: nothing to keep there).
            self._sender.adopt(self.hf_weights())

    def broadcast_weights(self, version: int) -> UpdateReceipt:
        if self._sender is None:
            raise RuntimeError("broadcast_weights before join_weight_group")
        with torch.no_grad():  # the caller pinned the weights (pin_weights)
            return self._sender.send(self.hf_weights(), version)

    def pin_weights(self, version: int) -> bool:
        # Released by unpin_weights, from another call (possibly another thread): a plain Lock allows it.
        self._weights_lock.acquire()
        if self.version > version:  # trained past it (a resumed run may not have counted up to it)
            self._weights_lock.release()
            return False
        return True

    def unpin_weights(self) -> None:
        if self._weights_lock.locked():
            self._weights_lock.release()

    def param_checksum(self) -> ParamChecksum:
        with self._weights_lock:
            return checksum_of(self.hf_weights().values())

    # ---- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        d = Path(directory)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            self.gather_weights()
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            optim = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        else:
            optim = self.optimizer.state_dict()  # replicas: rank 0's is everyone's
        if self.rank == 0:
            write_hf_folder(checkpoint_model_dir(d), self._model_files, self.hf_weights())
            state = {
                "step": self.step_count,
                "optimizer": optim,
                "scheduler": self.scheduler.state_dict(),
                "parallel": self.s.parallel,
                "world_size": self.world_size,
                "algorithm": self.algo.state_dict(),  # ppo's critic (replicated: rank 0's is everyone's)
            }
            torch.save(state, d / TRAINER_STATE)
        torch.save(rng_state(), d / f"rng_rank{self.rank}.pt")
        if dist.is_initialized():
            dist.barrier()

    def load_checkpoint(self, directory: str) -> int:
        d = Path(directory)
        weights = read_hf_weights(checkpoint_model_dir(d))
        missing = [n for n in self._param_names if n not in weights]
        if missing:
            raise RunError(f"checkpoint '{d}': model weights miss {len(missing)} parameter(s), e.g. '{missing[0]}'")
        # Our own file (optimizer state plus Python objects): not an untrusted download.
        state = torch.load(d / TRAINER_STATE, map_location="cpu", weights_only=False)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self.model, {n: weights[n] for n in self._param_names}, options=opts)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=opts)
        else:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(weights[name])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("algorithm"):
            self.algo.load_state_dict(state["algorithm"])
        self.step_count = int(state["step"])
        rng_file = d / f"rng_rank{self.rank}.pt"
        if not rng_file.is_file():  # more ranks than when saved: start from rank 0's streams
            rng_file = d / "rng_rank0.pt"
        set_rng_state(torch.load(rng_file, weights_only=False))
        self._full = None
        if dist.is_initialized():
            dist.barrier()
        return self.step_count

    def redirect_buffer(self, address: str) -> None:
        self.batches.redirect(address)

    def shutdown(self) -> None:
        if self._weight_info is not None and self._weight_info.shm_path:
            ShmChannel.unlink(self._weight_info.shm_path)  # opened but never joined
        if self.batches is not None:
            self.batches.close()
            self.batches = None
        if dist.is_initialized():
            dist.destroy_process_group()
