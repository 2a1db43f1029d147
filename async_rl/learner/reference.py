"""The frozen reference policy for the KL penalty: the initial weights, loaded once, never trained."""

from __future__ import annotations

import torch


class ReferencePolicy:
    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        # Loaded from the checkpoint the run started from (not copied from the live model): the same
        # weights whatever wrapping (DDP, FSDP) the trained model has, and the same after a resume.
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model.eval()
        self.model.requires_grad_(False)
