"""The learner settings an MoE (or dense) model does not take, read from its config.json alone (no torch):
the launcher refuses them before anything starts, the torch backend again from the loaded model."""

from __future__ import annotations

import json
from pathlib import Path

from async_rl.config import LearnerConfig


def routed_experts(model_config: dict) -> int:
    """Routed experts per MoE layer named by an HF config (Qwen2/3-MoE and OLMoE: num_experts; Mixtral
    style: num_local_experts); 0 for a dense model."""
    return int(model_config.get("num_experts") or model_config.get("num_local_experts") or 0)


def settings_error(learner: LearnerConfig, experts: int) -> str | None:
    """One line naming the learner setting this model does not take, or None."""
    if not experts and learner.routing_replay == "on":
        return "learner.routing_replay=on: the model is dense (no MoE router); use auto or off"
    if experts and learner.lora.enabled and learner.backend == "torch":
        return (f"learner.lora: not with an MoE model ({experts} experts per MoE layer): its experts are 3D "
                "parameters PEFT does not target; train it without lora")
    if experts and learner.backend == "megatron" and (why := megatron_aux_loss_error(learner.moe_aux_loss_coef)):
        return why
    if experts and learner.sequence_parallel_size > 1:
        return (f"learner.sequence_parallel_size={learner.sequence_parallel_size}: not with an MoE model yet (the "
                "recorded routes are not split across sequence-parallel ranks); set it to 1")
    return None


def megatron_aux_loss_error(coef: float) -> str | None:
    """learner.moe_aux_loss_coef with the megatron backend on an MoE model: refused. Megatron's own aux loss
    enters the backward through its MoEAuxLossAutoScaler, normalised by its own token counts rather than the
    driver's loss tokens, and reports no value the driver sees: not the torch backend's term."""
    if coef > 0:
        return (f"learner.moe_aux_loss_coef={coef} is not supported by learner.backend=megatron yet; set it to 0 "
                "or use learner.backend=torch")
    return None


def folder_settings_error(learner: LearnerConfig, model_dir: Path) -> str | None:
    """`settings_error` for the HF folder `model_dir` (its config.json)."""
    config = json.loads((model_dir / "config.json").read_text())
    return settings_error(learner, routed_experts(config.get("text_config", config)))
