"""Hugging Face checkpoint folders and RNG state: what every learner backend writes and reads.

A checkpoint's model folder is a plain HF folder: config.json, tokenizer and generation files copied
from the source model folder, and `model.safetensors` (or shards plus `model.safetensors.index.json`)
under HF parameter names, so `AutoModelForCausalLM.from_pretrained` and vLLM load it directly.
A tied output embedding is stored once, under the input embedding's name, as `save_pretrained` does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Files of the source folder that hold weights: never copied, the checkpoint writes its own.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = (INDEX_NAME, "pytorch_model.bin.index.json")


def read_model_files(source: Path) -> dict[str, bytes]:
    """config.json, tokenizer, generation config and the like: every non-weight file of `source`.
    Read once at start-up: the source may be a checkpoint that retention removes later."""
    return {
        f.name: f.read_bytes()
        for f in Path(source).iterdir()
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES
    }


def write_safetensors(target: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int = 4 << 30) -> None:
    """HF-style weights: one file, or shards of at most `max_shard_bytes` with an index."""
    from safetensors.torch import save_file

    host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in host.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(target / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(target / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in host.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (target / INDEX_NAME).write_text(json.dumps(index, indent=2))


def write_hf_folder(target: Path, model_files: dict[str, bytes], tensors: dict[str, torch.Tensor]) -> None:
    """`model_files` from `read_model_files` of the folder the model was loaded from."""
    target.mkdir(parents=True, exist_ok=True)
    for name, data in model_files.items():
        (target / name).write_bytes(data)
    write_safetensors(target, tensors)


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's safetensors file(s), by name (on CPU)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / INDEX_NAME
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [WEIGHTS_NAME]
    out: dict[str, torch.Tensor] = {}
    for fname in files:
        out.update(load_file(str(folder / fname)))
    return out


def rng_state() -> dict:
    """Every RNG a learner rank draws from: Python, NumPy, torch CPU and (if present) CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
