"""What a learner rank is started with: its spec (the config sections it is configured by and the
facts of this run) and its process environment. Built by the control plane (control/settings.py,
control/runtime.py) and read by the learner, so it lives below both."""

from __future__ import annotations

import msgspec

from async_rl.config.algorithm import AlgorithmConfig
from async_rl.config.data import VisionConfig
from async_rl.config.generators import GeneratorConfig
from async_rl.config.infra import WeightSyncConfig
from async_rl.config.learner import LearnerConfig
from async_rl.config.model import ModelConfig
from async_rl.config.train import SftConfig, TrainConfig
from async_rl.security import ClientKeys

# The learner rank's process environment (Ray's runtime_env env_vars; merged with the job's): one
# malloc arena for all its threads. Only concurrent allocations contend for it, and a rank's step
# runs on one thread at a time.
LEARNER_ENV = {"MALLOC_ARENA_MAX": "1"}


class LearnerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a learner rank is told when it starts: the config sections it is configured by, as they
    are, and the facts of this run."""

    model: ModelConfig  # dtype (the path is resolved into `model_dir`)
    learner: LearnerConfig
    algorithm: AlgorithmConfig
    generators: GeneratorConfig  # max_tokens (Dr.GRPO's normaliser) and the sampling temperature
    train: TrainConfig  # seed, total_steps (LR schedule), mismatch_probe_samples
    weight_sync: WeightSyncConfig  # with `backend` resolved ('gloo', 'shm', 'nccl' or 'cuda_ipc')
    run_id: str
    model_dir: str  # the HF folder the weights start from (a checkpoint's model/ on resume)
    reference_model_dir: str  # the run's initial weights: the frozen KL reference, the same across resumes
    buffer_address: str
    batch_timeout_s: float = 600.0
    curve: ClientKeys | None = None  # the learner's CURVE keys for the buffer (None: security.curve off)
    sft: SftConfig = msgspec.field(default_factory=SftConfig)  # train.mode=sft: the demonstrations
    vision: VisionConfig = msgspec.field(default_factory=VisionConfig)  # a VLM's pixel bounds (the engines')
