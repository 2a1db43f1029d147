"""LoRA on the torch learner, with PEFT: wrapping, the adapter's tensors under PEFT names, its checksum
as vLLM serves it, and its files (adapter_model.safetensors + adapter_config.json).

The base weights stay frozen and are the KL reference (the adapter disabled: no second copy).
On a vision-language model the adapter goes on its language model only (`language_model_targets`):
its vision tower has modules of the same names (Qwen2.5-VL's ViT blocks have gate/up/down_proj), and
vLLM puts LoRA layers on the language model alone.
The adapter crosses every boundary (the weight sync, checkpoints, vLLM) under the names of
`peft.get_peft_model_state_dict` ("base_model.model.<module>.lora_A.weight"), which vLLM's
`LoRAModel.from_lora_tensors` and `PeftModel.from_pretrained` read.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from async_rl.config import LoraConfig
from async_rl.errors import ConfigError, RunError, first_line

ADAPTER_NAME = "default"  # PEFT's adapter name; it is not part of the saved names
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def peft_config(cfg: LoraConfig, target_modules: list[str] | str | None = None):
    """PEFT's config of learner.lora; `target_modules`: PEFT's own form of the targets where they are not
    the configured names as they are (a VLM's: `language_model_targets`)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules) if target_modules is None else target_modules,
        init_lora_weights=True if cfg.init == "default" else "gaussian",
        bias="none",
        task_type="CAUSAL_LM",
    )


def language_model_prefix(model: torch.nn.Module) -> str:
    """The module name of a vision-language model's language model (transformers' `get_decoder()`;
    Qwen2.5-VL: 'model.language_model')."""
    decoder = model.get_decoder()
    for name, module in model.named_modules():
        if module is decoder and name:
            return name
    raise ConfigError(f"learner.lora: {type(model).__name__} names no language model (get_decoder) to put the adapter on")


def language_model_targets(model: torch.nn.Module, targets: list[str]) -> str:
    """PEFT's target_modules for the language model of a VLM alone: a regular expression PEFT matches
    against whole module names, e.g. `^model\\.language_model\\.(?:.*\\.)?(?:q_proj|k_proj)$`. It is
    saved as is in adapter_config.json, from which PEFT picks the same modules again."""
    names = "|".join(re.escape(t) for t in targets)
    return rf"^{re.escape(language_model_prefix(model))}\.(?:.*\.)?(?:{names})$"


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, vision: bool = False) -> torch.nn.Module:
    """The PEFT model around `model`: base weights frozen (a VLM's vision tower and projector included),
    only the adapter requires grad; `vision`: `model` is a VLM, whose adapter goes on its language
    model only."""
    from peft import get_peft_model

    targets = language_model_targets(model, list(cfg.target_modules)) if vision else None
    try:
        return get_peft_model(model, peft_config(cfg, targets))
    except ValueError as exc:  # e.g. a target module the model does not have
        raise ConfigError(f"learner.lora.target_modules: {first_line(exc, limit=500)}") from None


PEFT_PREFIX = "base_model.model."  # what PEFT puts before the HF model's own names when it saves


def is_adapter(hf_param_name: str) -> bool:
    return ".lora_" in hf_param_name


def saved_name(hf_param_name: str) -> str:
    """The HF model's name of an adapter parameter ('model.layers.0.self_attn.q_proj.lora_A.default.weight')
    -> its saved (and vLLM's) name ('base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight')."""
    return PEFT_PREFIX + hf_param_name.replace(f".{ADAPTER_NAME}.", ".")


def adapter_parameters(hf_model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters themselves (same storage every call), under their saved names, from
    the HF model PEFT injected its layers into."""
    return {saved_name(n): p for n, p in hf_model.named_parameters() if is_adapter(n)}


def adapter_config_dict(peft_model: torch.nn.Module, base_model_dir: str = "") -> dict:
    """adapter_config.json's content (what vLLM's PEFTHelper and PEFT read)."""
    d = peft_model.peft_config[ADAPTER_NAME].to_dict()
    if base_model_dir:
        d["base_model_name_or_path"] = base_model_dir
    return {k: sorted(v) if isinstance(v, set) else v for k, v in d.items()}


def scaling(config: dict) -> float:
    """How the adapter's update is scaled (vLLM folds it into lora_B when it loads an adapter)."""
    return float(config["lora_alpha"]) / float(config["r"])


def served_tensors(
    adapter: dict[str, torch.Tensor], config: dict, wire_dtype: torch.dtype | None = None
) -> Iterator[torch.Tensor]:
    """The adapter as vLLM computes with it: lora_A as is, lora_B times alpha / r (vLLM's
    `LoRALayerWeights.optimize` does that multiplication in the adapter's dtype, so the values agree
    bit for bit). The checksum of these is comparable with what an engine reads back from its slot."""
    s = scaling(config)
    for name, t in adapter.items():
        t = t.detach() if wire_dtype is None else t.detach().to(wire_dtype)
        yield t * s if ".lora_B." in name else t


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model: what the KL reference scores with (no second copy of the weights)."""
    with model.disable_adapter():
        yield


def save_adapter(directory: Path, adapter: dict[str, torch.Tensor], config: dict) -> None:
    """PEFT's format: `PeftModel.from_pretrained(base, directory)` and vLLM's LoRARequest load it."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().cpu().contiguous() for n, t in adapter.items()}, str(directory / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))


def load_adapter(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    return load_file(str(directory / ADAPTER_WEIGHTS)), json.loads((directory / ADAPTER_CONFIG).read_text())


def copy_into(params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor], where: str) -> None:
    """Load saved adapter tensors into the live parameters (names must match exactly)."""
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise RunError(f"{where}: the adapter misses {len(missing)} tensor(s), e.g. '{missing[0]}'")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])


def trainable(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [p for p in params if p.requires_grad]
