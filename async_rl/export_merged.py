"""python -m async_rl.export_merged CHECKPOINT OUT [--base DIR]: a LoRA checkpoint as one HF model folder.

The checkpoint's adapter (CHECKPOINT/adapter, PEFT format) is merged into the run's base weights (the
initial model folder recorded in the checkpoint, or --base) with PEFT's `merge_and_unload`, and written
like every checkpoint's model folder (config and tokenizer files of the base, safetensors under HF
names): `from_pretrained` and vLLM load it as a plain model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from async_rl.control import checkpoint
from async_rl.errors import RunError
from async_rl.learner.base import checkpoint_adapter_dir
from async_rl.learner.hf_io import read_model_files, write_hf_folder
from async_rl.learner.model.lora import ADAPTER_CONFIG
from async_rl.vision import is_vision_model


def base_model_dir(ckpt: Path) -> Path:
    """The base weights the run's adapter was trained on (recorded in every checkpoint)."""
    recorded = checkpoint.load_state(ckpt).initial_model_dir
    if not recorded:
        raise RunError(f"checkpoint '{ckpt}': no base model folder recorded; give --base DIR")
    return Path(recorded)


def export_merged(ckpt: Path, out: Path, base: Path | None = None, dtype: torch.dtype = torch.float32) -> Path:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    adapter = checkpoint_adapter_dir(ckpt)
    if not (adapter / ADAPTER_CONFIG).is_file():
        raise RunError(f"checkpoint '{ckpt}': no LoRA adapter in '{adapter}' (a full-weight checkpoint is already a model folder: model/)")
    base = base or base_model_dir(ckpt)
    # A VLM as the learner loads it (its vision tower and projector are the base's: the adapter is on
    # its language model only), so that its parameter names are those of its own checkpoints.
    auto = AutoModelForImageTextToText if is_vision_model(base) else AutoModelForCausalLM
    model = auto.from_pretrained(str(base), dtype=dtype)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    # named_parameters lists a tied output embedding once, as every checkpoint writes it
    write_hf_folder(out, read_model_files(base), {n: p.detach() for n, p in merged.named_parameters()})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m async_rl.export_merged", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="RUN_DIR/checkpoints/step_N of a learner.lora run")
    p.add_argument("out", type=Path, help="the HF model folder to write")
    p.add_argument("--base", type=Path, default=None, help="base model folder (default: the one the run recorded)")
    args = p.parse_args(argv)
    try:
        out = export_merged(args.checkpoint, args.out, args.base)
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"merged model written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
