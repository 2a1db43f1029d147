"""The learner settings an MoE (or dense) model does not take, from its routed experts alone (no torch): the
launcher refuses them before anything starts (from the routing it resolves: models/tiny.model_routing), the
torch backend again from the loaded model."""

from __future__ import annotations

from async_rl.config import LearnerConfig


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

