"""The real workload of bench_e2e.py --preset real and bench_limits.py: SmolLM2-135M-Instruct on arithmetic.

configs/smollm2_arith.yaml's data (configs/data/arith_train.jsonl, its system prompt, the model's
chat template) with natural EOS and a max_tokens cap. Both the system runs and the phase / limit
probes take their prompts from here, in file order (the runs set data.shuffle=false and TRL reads
the file in order too), so every side works on the same questions.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "smollm2_arith.yaml"
TRAIN_FILE = REPO / "configs" / "data" / "arith_train.jsonl"
MODEL = "smollm2-135m"
MAX_PROMPT_TOKENS = 64  # the rendered arithmetic prompts are ~40 tokens; room left in max_model_len


def system_prompt() -> str:
    from async_rl.config import load_config

    return load_config(CONFIG).data.system_prompt


def rendered_prompts(n: int) -> list:
    """The first `n` training prompts of the arithmetic data, rendered with the chat template (Prompt
    objects with token_ids), in file order."""
    from async_rl.config import load_config
    from async_rl.data import load_prompt_files, make_renderer
    from async_rl.models.tiny import resolve_model_path

    cfg = load_config(CONFIG)
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    loaded = load_prompt_files([str(TRAIN_FILE)], cfg.data, make_renderer(cfg, model_dir), MAX_PROMPT_TOKENS,
                               "data.train_files")
    if len(loaded.prompts) < n:
        raise ValueError(f"{TRAIN_FILE} has {len(loaded.prompts)} usable rows, {n} wanted")
    return loaded.prompts[:n]
