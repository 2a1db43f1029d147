"""Run inside a GeneratorEngine actor (Ray `__ray_call__`) by test_lora_real: importable by the actor."""

from __future__ import annotations


def deliver_into_another_slot(engine) -> None:
    """The engine's next update lands in a LoRA id no request names (verl #7495's failure)."""
    engine.adapter_slot = 2


def base_probe(driver, max_samples: int):
    """A learner rank's probe of its last batch (`LearnerDriver.probe_logprobs`) scored by the base model:
    the adapter disabled (PEFT), the same tokens and images."""
    with driver.backend.peft.disable_adapter():
        return driver.probe_logprobs(max_samples)
