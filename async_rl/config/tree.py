"""The root of the config tree: one field per section."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from async_rl.config.algorithm import AlgorithmConfig
from async_rl.config.base import _f, _Section
from async_rl.config.data import DataConfig, TaskConfig, VisionConfig
from async_rl.config.env import EnvConfig
from async_rl.config.evaluation import EvalConfig
from async_rl.config.generators import GeneratorConfig
from async_rl.config.infra import BufferConfig, LoggingConfig, RayConfig, SecurityConfig, WeightSyncConfig
from async_rl.config.learner import LearnerConfig
from async_rl.config.model import ModelConfig
from async_rl.config.rewards import TeacherConfig
from async_rl.config.train import SftConfig, TrainConfig


class Config(_Section):
    placement: Annotated[
        Literal["disaggregated", "colocated"],
        _f("disaggregated: generators and learner on separate cores/GPUs, asynchronous; colocated: they "
           "share them and alternate (needs train.max_lag 0; on cuda each GPU holds one engine and one "
           "learner rank)"),
    ] = "disaggregated"
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    vision: VisionConfig = msgspec.field(default_factory=VisionConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    generators: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    teacher: TeacherConfig = msgspec.field(default_factory=TeacherConfig)
    sft: SftConfig = msgspec.field(default_factory=SftConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    weight_sync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
