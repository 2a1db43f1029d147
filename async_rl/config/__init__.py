"""The typed config tree: YAML file + `section.key=value` overrides -> msgspec Structs.

Every field carries a one-line description (msgspec `Meta(description=...)`); `describe()` prints
them, and `--dry-run` prints the resolved values. Errors are one line that names the key.

The tree is split by section, one module each; this package re-exports every public name, so
`from async_rl.config import X` names any of them.
"""

from async_rl.config.algorithm import AlgorithmConfig
from async_rl.config.base import DEVICE_AUTO, Device
from async_rl.config.data import DataConfig, TaskConfig, VisionConfig
from async_rl.config.env import VERIFIERS_ID_PATTERN, EnvConfig
from async_rl.config.evaluation import EvalConfig
from async_rl.config.generators import AutoscaleConfig, GeneratorConfig
from async_rl.config.infra import (
    BufferConfig,
    LoggingConfig,
    RayConfig,
    SecurityConfig,
    WandbConfig,
    WeightSyncConfig,
)
from async_rl.config.learner import LORA_TARGETS, LearnerConfig, LoraConfig, MegatronConfig
from async_rl.config.loading import MOVED_KEYS, apply_override, describe, load_config, to_dict, to_yaml
from async_rl.config.model import MODEL_PRESETS, ModelConfig
from async_rl.config.rewards import (
    CLASSIFIER_PREFIX,
    DEFAULT_JUDGE_TEMPLATE,
    JUDGE_PLACEHOLDERS,
    JUDGE_PREFIX,
    JUDGE_REQUIRED,
    ClassifierConfig,
    JudgeConfig,
    RewardModelServing,
    TeacherConfig,
    VllmReplicaServing,
)
from async_rl.config.train import SftConfig, TrainConfig
from async_rl.config.tree import Config
from async_rl.config.validation import (
    COLOCATED_LEARNER_SHARE,
    check_data_files,
    check_judge_template,
    data_parallel_size,
    reward_model_serving,
    template_fields,
    validate,
    validate_algorithm,
    validate_data,
    validate_devices,
    validate_env,
    validate_eval,
    validate_lora,
    validate_reward_model,
    validate_sampling,
    validate_sft,
    validate_teacher,
    verifiers_id_error,
)
from async_rl.errors import ConfigError  # the one-line error a config raises

__all__ = [
    "ConfigError",
    "AlgorithmConfig",
    "AutoscaleConfig",
    "BufferConfig",
    "CLASSIFIER_PREFIX",
    "COLOCATED_LEARNER_SHARE",
    "ClassifierConfig",
    "Config",
    "DEFAULT_JUDGE_TEMPLATE",
    "DEVICE_AUTO",
    "DataConfig",
    "Device",
    "EnvConfig",
    "EvalConfig",
    "GeneratorConfig",
    "JUDGE_PLACEHOLDERS",
    "JUDGE_PREFIX",
    "JUDGE_REQUIRED",
    "JudgeConfig",
    "LORA_TARGETS",
    "LearnerConfig",
    "LoggingConfig",
    "LoraConfig",
    "MODEL_PRESETS",
    "MOVED_KEYS",
    "MegatronConfig",
    "ModelConfig",
    "RayConfig",
    "RewardModelServing",
    "SecurityConfig",
    "SftConfig",
    "TaskConfig",
    "TeacherConfig",
    "TrainConfig",
    "VERIFIERS_ID_PATTERN",
    "VisionConfig",
    "VllmReplicaServing",
    "WandbConfig",
    "WeightSyncConfig",
    "apply_override",
    "check_data_files",
    "check_judge_template",
    "data_parallel_size",
    "describe",
    "load_config",
    "reward_model_serving",
    "template_fields",
    "to_dict",
    "to_yaml",
    "validate",
    "validate_algorithm",
    "validate_data",
    "validate_devices",
    "validate_env",
    "validate_eval",
    "validate_lora",
    "validate_reward_model",
    "validate_sampling",
    "validate_sft",
    "validate_teacher",
    "verifiers_id_error",
]
