"""`bench_learner.py --longest`: the longest single sequence whose learner step trains on one GPU, per model
shape and activation checkpointing off and on; with SP = 2/4 what each rank would hold (an estimate).

    python benchmarks/bench_learner.py --longest [--device cuda] [--out gpu/<DATE>-longest] [--dry-run]
        [--shapes qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b] [--checkpointing off,on] [--start 4096]
        [--resolution 1024] [--max-length 131072] [--time-cap-s 60] [--setting-timeout-s 240] [--budget-s 510]
    python benchmarks/bench_learner.py --longest --device cpu --shapes tiny --fake-budget-mib 48  # CPU smoke

writes benchmarks/results/<out>.json and .md (after every setting: a run killed later keeps what it found).

Each (shape, checkpointing) runs in its own process (CUDA): a random-init model of `learner_gpu.SHAPES[shape]`
saved once in bf16; the torch backend on one rank loads fp32 master weights and trains on a bf16 working
copy as the GPU recipes do (learner.mixed_precision, kernels, attention and logprob_keep_logits at auto;
the chunked head of 1,024 positions); one warm-up step of --resolution tokens (AdamW's state is made
there, so every try counts it); then the search (`search_longest`) over one sample's length (a 256-token
prompt, the rest completion, one micro-batch; forward, backward, clipping, AdamW): doubling from --start
while steps fit, halving while the first does not, then bisection to --resolution. A try does not fit
when its step raises torch.OutOfMemoryError (or a CUDA library's "out of memory"); the rank then drops
its gradients, collects garbage and empties the caching allocator before the next. No try starts after
--time-cap-s of tries or beyond --max-length: the row says which bound stopped the search. Reported per
setting: the length, the step's seconds and peak memory (torch.cuda.max_memory_allocated) at that length,
what the rank held before the step, and every try. `--memory-fraction F` caps each setting's allocator
at F of the GPU (0.56 reads an 80 GB limit on a 141 GB H200). The length found is a lower bound of the true limit
within --resolution (tries after a failed one run on a caching allocator that a failure may have
fragmented).

A shape whose fp32 weights, gradients and AdamW moments with the bf16 copy (18 bytes a parameter,
estimated before anything is built) exceed the GPU is reported as not fitting without building it: the
7B shape on an 80 GB H100 (on a 141 GB H200 it leaves ~10 GiB for a step).

SP = 2/4 (learner.sequence_parallel_size) is not run (one GPU). What each rank would hold at the length
found is an ESTIMATE from learner/batch/token_budget.py: activations per token (8h + 4kv + 4I elements a
layer, one hidden state a layer with checkpointing, x2.0 margin) and kept logits, both / SP; the head's
chunk; the state, either a replica on every rank (DDP and one rank: fp32 masters, the bf16 copy,
gradients, AdamW) or sharded over the SP ranks (FSDP2 at world = SP, the long-context recipe). The
measured SP = 1 point calibrates it: `scale` = the step's measured growth beyond the estimated state over
the estimate's activations at that length; the longest length at SP is then where the scaled estimate
meets the SP = 1 peak (the memory known to be usable). Beside it, the estimate alone within the GPU less
token_budget's 10% reserve (what `micro_batch_tokens: auto` counts on): its SP = 1 row against the
measured length checks that count on the device.

Without CUDA: one last line `SKIP: <reason>`, exit 3 (scripts/gpu_check.py's convention). `--device cpu`
(the CPU smoke, in this process, seconds): the same search through the same backend, with a fake memory:
autograd's saved tensors counted during the forward (parameters left out), torch.OutOfMemoryError raised
past --fake-budget-mib; host memory does not run out in a test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SKIP_RC = 3
PROMPT_TOKENS = 256
HEAD_CHUNK = 1024  # learner.logprob_chunk_tokens' default
DEFAULT_SHAPES = "qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b"
SP_SIZES = (1, 2, 4)
# Where no length trained on one GPU (or the shape was not built), what a rank would hold is stated at the
# long-context recipe's completion length (configs/gpu/8gpu_long_context_sp4.yaml: max_tokens 32768).
REFERENCE_LENGTH = 32768
GIB = 2**30


# ---- the search (pure: unit-tested with fake predicates) ---------------------------------------------------


@dataclass(frozen=True)
class Try:
    length: int
    fits: bool
    seconds: float


@dataclass
class Search:
    longest: int  # the longest length that fitted (0: none did)
    shortest_failed: int | None  # the shortest length that did not (None: none failed)
    stopped: str  # what ended the search: resolution | max length | time cap | shortest length failed
    tries: list[Try] = field(default_factory=list)


def search_longest(fits: Callable[[int], bool], *, start: int, resolution: int, max_length: int, time_cap_s: float,
                   clock: Callable[[], float] = time.monotonic) -> Search:
    """The longest length in multiples of `resolution` for which `fits` holds, assuming it holds below
    any length that fits (memory grows with length): doubling from `start` while lengths fit (up to
    `max_length`), halving while they do not (down to `resolution`), then bisection until the longest
    fit and the shortest failure are `resolution` apart. No try starts once `time_cap_s` has passed on
    `clock` since the first; `fits` raising anything propagates."""
    if not 0 < resolution <= start <= max_length:
        raise ValueError(f"need 0 < resolution ({resolution}) <= start ({start}) <= max_length ({max_length})")
    t0 = clock()
    found = Search(0, None, "")

    def attempt(n: int) -> bool:
        t = clock()
        ok = bool(fits(n))
        found.tries.append(Try(n, ok, clock() - t))
        if ok:
            found.longest = max(found.longest, n)
        else:
            found.shortest_failed = n if found.shortest_failed is None else min(found.shortest_failed, n)
        return ok

    def done(why: str) -> Search:
        found.stopped = why
        return found

    n = start // resolution * resolution
    while found.longest == 0 or found.shortest_failed is None:  # 1. a bracket
        if clock() - t0 >= time_cap_s:
            return done("time cap")
        if attempt(n):
            if n >= max_length:
                return done("max length")
            n = min(2 * n, max_length)
        elif found.longest == 0:
            if n <= resolution:
                return done("shortest length failed")
            n = max(n // 2 // resolution * resolution, resolution)
    while found.shortest_failed - found.longest > resolution:  # 2. bisection
        if clock() - t0 >= time_cap_s:
            return done("time cap")
        mid = (found.longest + found.shortest_failed) // 2 // resolution * resolution
        attempt(max(mid, found.longest + resolution))
    return done("resolution")


# ---- what a rank holds (the token-budget estimate) ----------------------------------------------------------


def dense_params(fields: dict) -> int:
    """Parameters of a Qwen2-style decoder of these config fields (q/k/v biases, gated MLP, two norms a
    layer), counted without building it."""
    h, inter, layers, vocab = (fields[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    kv = h * fields["num_key_value_heads"] // fields["num_attention_heads"]
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h
    return layers * per_layer + vocab * h * (1 if fields.get("tie_word_embeddings") else 2) + h


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes at a sequence length (an estimate)."""

    sp: int
    parallel: str  # replica (DDP, one rank) | fsdp2 (state sharded over the SP ranks)
    weights: int  # fp32 masters (+ the bf16 working copy of a replica)
    gradients_optimizer: int  # fp32 gradients and AdamW's two moments
    head: int  # the chunked head's fp32 chunk tensors
    activations: int  # saved activations and kept logits of this rank's 1 / SP of the tokens

    @property
    def state(self) -> int:
        return self.weights + self.gradients_optimizer + self.head

    @property
    def total(self) -> int:
        return self.state + self.activations


def activation_bytes(shape, length: int, *, sp: int, compute_bytes: int, checkpointing: bool, keeps_logits: bool,
                     margin: float | None = None) -> int:
    """The token-budget estimate of one rank's activations for one sequence of `length` tokens split over
    `sp` ranks (`margin` None: token_budget's)."""
    from async_rl.learner.batch.token_budget import (
        MARGIN,
        activation_bytes_per_token,
        kept_logits_bytes_per_token,
    )

    per_token = activation_bytes_per_token(shape, compute_bytes, checkpointing, MARGIN if margin is None else margin)
    per_token += kept_logits_bytes_per_token(shape.vocab_size, compute_bytes, keeps_logits, HEAD_CHUNK)
    return per_token * -(-length // sp)


def rank_memory(shape, params: int, length: int, *, sp: int, parallel: str, compute_bytes: int, checkpointing: bool,
                keeps_logits: bool, working_copy: bool) -> RankMemory:
    from async_rl.learner.batch.token_budget import head_chunk_bytes, step_state_bytes

    shards = sp if parallel == "fsdp2" else 1
    copy = params * compute_bytes if working_copy and parallel == "replica" else 0
    return RankMemory(
        sp=sp, parallel=parallel, weights=params * 4 // shards + copy,
        gradients_optimizer=step_state_bytes(params) // shards, head=head_chunk_bytes(HEAD_CHUNK, shape.vocab_size),
        activations=activation_bytes(shape, length, sp=sp, compute_bytes=compute_bytes, checkpointing=checkpointing,
                                     keeps_logits=keeps_logits))


def per_rank_rows(shape, params: int, measured: dict, *, compute_bytes: int, checkpointing: bool, keeps_logits: bool,
                  working_copy: bool, resolution: int, capacity: int | None = None) -> list[dict]:
    """SP = 1/2/4, replica and FSDP2: what a rank holds at the measured longest length; `longest_estimate`:
    where the estimate, scaled to the measured SP = 1 step, reaches that step's peak (None without a
    measured peak); `predicted`: the estimate alone within `capacity` less token_budget's reserve (what
    `micro_batch_tokens: auto` would count on; None without a capacity)."""
    from async_rl.learner.batch.token_budget import RESERVE

    length = measured.get("longest", 0)
    if not length:
        return []
    kw = dict(compute_bytes=compute_bytes, checkpointing=checkpointing, keeps_logits=keeps_logits,
              working_copy=working_copy)
    one = rank_memory(shape, params, length, sp=1, parallel="replica", **kw)
    peak = measured.get("peak_bytes")
    scale = (peak - one.state) / one.activations if peak else None

    def reach(room: float, per_token: float) -> int:
        return max(int(room / per_token) // resolution * resolution, 0)

    rows = []
    for sp in SP_SIZES:
        for parallel in ("replica", "fsdp2"):
            if sp == 1 and parallel == "fsdp2":
                continue
            m = rank_memory(shape, params, length, sp=sp, parallel=parallel, **kw)
            per_token = one.activations / length / sp  # this rank's share of a token, by the estimate
            rows.append({**asdict(m), "length": length, "state_bytes": m.state, "total_bytes": m.total,
                         "scale": scale,
                         "longest_estimate": reach(peak - m.state, per_token * scale) if scale and scale > 0 else None,
                         "predicted": reach(capacity * (1 - RESERVE) - m.state, per_token) if capacity else None})
    return rows


def per_rank_for(row: dict, fields: dict, *, cuda: bool, checkpointing: bool, resolution: int) -> list[dict]:
    """`per_rank_rows` of a setting's row: at its longest length, or at REFERENCE_LENGTH where nothing
    trained or the shape was not built (a row without a capacity, which never ran: none)."""
    import msgspec

    from async_rl.models.shape import ModelShape

    if "longest" not in row and "capacity_bytes" not in row:
        return []
    trained = row.get("longest", 0)
    measured = {"longest": trained or REFERENCE_LENGTH, "peak_bytes": row.get("peak_bytes") if cuda and trained else None}
    return per_rank_rows(msgspec.convert(fields, ModelShape), row.get("params") or dense_params(fields), measured,
                         compute_bytes=2 if cuda else 4, checkpointing=checkpointing,
                         keeps_logits=row.get("keeps_logits", cuda), working_copy=row.get("working_copy", cuda),
                         resolution=resolution, capacity=row.get("capacity_bytes") if cuda else None)


# ---- one setting: the backend, the fake or real memory, the search --------------------------------------------


class SavedBytesMeter:
    """A fake memory for the CPU smoke: autograd's saved tensors during a forward (each storage once,
    the parameters' own left out), torch.OutOfMemoryError past `budget` bytes."""

    def __init__(self, budget: int, parameters) -> None:
        self.budget = budget
        self.weights = {p.untyped_storage().data_ptr() for p in parameters}
        self.saved: dict[int, int] = {}
        self.peak = 0

    @contextlib.contextmanager
    def watch(self):
        import torch

        self.saved = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in self.weights:
                self.saved[s.data_ptr()] = s.nbytes()
                used = sum(self.saved.values())
                self.peak = max(self.peak, used)
                if used > self.budget:
                    raise torch.OutOfMemoryError(f"fake memory: {used / 2**20:.1f} MiB of saved activations over "
                                                 f"the {self.budget / 2**20:.1f} MiB budget")
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


def is_oom(e: BaseException) -> bool:
    import torch

    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text.lower() or "ALLOC_FAILED" in text


def make_sample(length: int, vocab: int, seed: int):
    import numpy as np

    from async_rl.learner.batch.packing import SeqSample

    rng = np.random.default_rng(seed)
    completion = length - PROMPT_TOKENS
    return SeqSample(tokens=rng.integers(10, vocab, length).astype(np.int64), start=PROMPT_TOKENS,
                     behav_logp=np.full(completion, -3.0, np.float32),
                     advantages=rng.standard_normal(completion).astype(np.float32))


def state_fits(fields: dict, total_bytes: int) -> str | None:
    """Why this shape's state alone cannot fit `total_bytes` (None: it may)."""
    params = dense_params(fields)
    state = params * (4 + 2) + params * 12
    if state <= total_bytes * 0.97:
        return None
    return (f"does not fit: {params / 1e9:.2f}B parameters' fp32 masters, bf16 copy, gradients and AdamW state "
            f"come to {state / GIB:.1f} GiB (estimate) of the GPU's {total_bytes / GIB:.1f} GiB; not built")


def measure_setting(a: argparse.Namespace, report: Callable[[dict], None] = lambda row: None) -> dict:
    """One (shape, checkpointing): the search on this process's device. `report` gets every try as it ends."""
    import torch
    from learner_gpu import SHAPES, make_model

    from async_rl.config import LearnerConfig
    from async_rl.learner.batch.packing import packed
    from async_rl.learner.torch_backend import TorchBackend

    cuda = a.device == "cuda"
    fields = {k: v for k, v in SHAPES[a.shape].items() if k != "family"}
    capacity = int(torch.cuda.get_device_properties(0).total_memory * a.memory_fraction) if cuda else 0
    if cuda and a.memory_fraction < 1:
        torch.cuda.set_per_process_memory_fraction(a.memory_fraction)
    if cuda and (why := state_fits(fields, capacity)):
        return {"skipped": why, "capacity_bytes": capacity, "params": dense_params(fields)}
    t0 = time.perf_counter()
    model_dir = Path(a.model_dir)
    if not (model_dir / "config.json").exists():
        make_model(model_dir, a.shape, max_positions=a.max_length)
        gc.collect()
        torch.cuda.empty_cache() if cuda else None
    cfg = LearnerConfig(device=a.device, lr=1e-6, micro_batch_tokens=0, activation_checkpointing=a.checkpointing == "on")
    from async_rl.cluster.net import free_port

    backend = TorchBackend(cfg, "float32", 0, 1, f"127.0.0.1:{free_port()}")
    params = backend.setup(str(model_dir))
    setup_s = time.perf_counter() - t0
    meter = None if cuda else SavedBytesMeter(int(a.fake_budget_mib * 2**20), backend.model.parameters())
    vocab = fields["vocab_size"]
    records: dict[int, dict] = {}

    def step(length: int) -> None:
        mb = packed([make_sample(length, vocab, length)]).to(backend.device)

        def loss_fn(i, scores):
            return -(scores.logp * mb.advantages * mb.loss_mask).sum() / max(1.0, float(mb.loss_mask.sum()))

        with meter.watch() if meter else contextlib.nullcontext():
            backend.forward_backward([mb], 1.0, loss_fn)
        backend.optimizer_step(1e-6, 1.0)

    def fits(length: int) -> bool:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated() if cuda else 0
        row: dict = {"length": length, "held_bytes": held}
        t = time.perf_counter()
        try:
            step(length)
            torch.cuda.synchronize() if cuda else None
            row.update(fits=True, step_s=time.perf_counter() - t,
                       peak_bytes=torch.cuda.max_memory_allocated() if cuda else meter.peak)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if not is_oom(e):
                raise
            row.update(fits=False, step_s=time.perf_counter() - t, error=str(e).splitlines()[0][:240])
        backend.drop_gradients()  # a failed step's partial gradients, and the next try's clean start
        gc.collect()
        torch.cuda.empty_cache() if cuda else None
        if meter:
            meter.peak = 0
        records[length] = row
        report(row)
        return row["fits"]

    warm = fits(a.resolution)  # AdamW's state is made here: every try after counts it
    result = {"shape": a.shape, "checkpointing": a.checkpointing, "params": params, "setup_s": setup_s,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu (fake memory)",
              "capacity_bytes": capacity if cuda else int(a.fake_budget_mib * 2**20),
              "kernels": backend.kernels, "attention": backend.attention_kernels.unshared,
              "keeps_logits": backend.keeps_logits, "working_copy": backend.working is not None,
              "warmup": records[a.resolution]}
    if warm:
        search = search_longest(fits, start=max(a.start, a.resolution), resolution=a.resolution,
                                max_length=a.max_length, time_cap_s=a.time_cap_s)
        best = records.get(search.longest, {})
        result.update(longest=search.longest, shortest_failed=search.shortest_failed, stopped=search.stopped,
                      step_s=best.get("step_s"), peak_bytes=best.get("peak_bytes"), held_bytes=best.get("held_bytes"),
                      search_s=sum(t.seconds for t in search.tries), tries=[records[t.length] for t in search.tries])
    else:
        result.update(longest=0, shortest_failed=a.resolution, stopped="warm-up failed", tries=[])
    backend.shutdown()
    gc.collect()
    torch.cuda.empty_cache() if cuda else None
    return result


# ---- the parent: a process per setting, the tables -------------------------------------------------------------


def child_command(a: argparse.Namespace, shape: str, checkpointing: str, model_dir: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", "--device", a.device, "--shape", shape,
            "--checkpointing", checkpointing, "--model-dir", str(model_dir), "--start", str(a.start),
            "--resolution", str(a.resolution), "--max-length", str(a.max_length), "--time-cap-s", str(a.time_cap_s),
            "--memory-fraction", str(a.memory_fraction), "--fake-budget-mib", str(a.fake_budget_mib)]


def from_tries(tries: list[dict]) -> dict:
    """What a killed or failed child's reported tries say."""
    ok = [t for t in tries if t.get("fits")]
    best = max(ok, key=lambda t: t["length"], default={})
    failed = [t["length"] for t in tries if not t.get("fits")]
    return {"longest": best.get("length", 0), "shortest_failed": min(failed, default=None),
            "step_s": best.get("step_s"), "peak_bytes": best.get("peak_bytes"), "held_bytes": best.get("held_bytes"),
            "tries": tries}


def run_child(cmd: list[str], timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out, err, why = proc.stdout, proc.stderr, f"exit {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired as e:
        def text(x) -> str:
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")

        out, err, why = text(e.stdout), text(e.stderr), f"killed after {timeout:.0f} s"
    lines = out.splitlines()
    results = [ln[7:] for ln in lines if ln.startswith("RESULT ")]
    if results and not why:
        return {**json.loads(results[-1]), "wall_s": time.perf_counter() - t}
    tries = [json.loads(ln[4:]) for ln in lines if ln.startswith("TRY ")]
    last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "")
    why = f"{why}: {last[:200]}" if last else why
    return {**from_tries(tries), "stopped": why, "error": why, "stderr_tail": err[-1500:],
            "wall_s": time.perf_counter() - t}


def gib(x: float | None) -> str:
    """Bytes as GiB (MiB below one: the CPU smoke's sizes)."""
    if x is None:
        return "-"
    return f"{x / GIB:.1f} GiB" if abs(x) >= GIB else f"{x / 2**20:.1f} MiB"


def tokens(n: int | None) -> str:
    return f"{n:,}" if n else ("0" if n == 0 else "-")


def write_markdown(result: dict, path: Path) -> None:
    cpu = result["device_kind"] == "cpu"
    lines = [f"# The longest sequence one {'CPU rank (fake memory)' if cpu else 'GPU'} trains ({result['date_utc']})",
             "",
             f"`{result['command']}`; {result['device']}{result['cap']}; torch {result['torch']}. "
             f"One sample: a {PROMPT_TOKENS}-token "
             f"prompt, the rest completion; one learner step (forward, backward, clipping, AdamW) per try; search "
             f"from {result['start']:,} tokens to {result['resolution']:,}-token resolution, at most "
             f"{result['max_length']:,} tokens and {result['time_cap_s']:.0f} s of tries a setting "
             "(`benchmarks/longest_sequence.py`).", "",
             "| shape | parameters | checkpointing | longest | stopped by | step at it | peak | held before the step "
             "| tries (search s) | ran as |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["settings"]:
        if "longest" not in r:
            lines.append(f"| {r['shape']} | - | {r['checkpointing']} | - | {r.get('skipped') or r.get('error')} "
                         "| - | - | - | - | - |")
            continue
        tries = ", ".join(f"{t['length'] / 1024:g}k {'ok' if t['fits'] else 'OOM'}" for t in r.get("tries", []))
        ran = (f"kernels {r.get('kernels', '-')}, attention {r.get('attention', '-')}, "
               f"bf16 copy {r.get('working_copy', '-')}, logits kept {r.get('keeps_logits', '-')}")
        step = f"{r['step_s']:.2f} s" if r.get("step_s") is not None else "-"
        lines.append(f"| {r['shape']} | {r.get('params', 0) / 1e6:,.0f}M | {r['checkpointing']} | "
                     f"{tokens(r['longest'])} | {r.get('stopped', '-')} | {step} | {gib(r.get('peak_bytes'))} | "
                     f"{gib(r.get('held_bytes'))} | {tries} ({r.get('search_s', 0):.0f} s) | {ran} |")
    lines += ["", "## What each rank would hold with sequence parallelism (an ESTIMATE, not measured)", "",
              "learner/batch/token_budget.py's count at the length found (SP = 1 measured above; SP = 2/4 not run: "
              "one GPU). `replica`: every rank holds fp32 masters, the bf16 copy, gradients and AdamW (DDP); "
              "`fsdp2`: those sharded over the SP ranks (world = SP, the long-context recipe). `scaled`: where the "
              "estimate, scaled to the measured SP = 1 step (`scale`), reaches that step's peak; `alone`: the "
              "estimate within the GPU less token_budget's 10% reserve, as `micro_batch_tokens: auto` counts "
              f"(its SP = 1 row against the measured length checks that count). Where nothing trained, or the shape "
              f"was not built, the length is {REFERENCE_LENGTH:,} (the long-context recipe's completions).", "",
              "| shape | checkpointing | length | SP | state | weights | gradients + AdamW | activations | total "
              "| scale | longest (scaled estimate) | longest (estimate alone) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["settings"]:
        for p in r.get("per_rank", []):
            scale = f"{p['scale']:.2f}" if p.get("scale") else "-"
            lines.append(f"| {r['shape']} | {r['checkpointing']} | {p['length']:,} | {p['sp']} {p['parallel']} | "
                         f"{gib(p['state_bytes'])} | {gib(p['weights'])} | {gib(p['gradients_optimizer'])} | "
                         f"{gib(p['activations'])} | {gib(p['total_bytes'])} | {scale} | "
                         f"{tokens(p['longest_estimate'])} | {tokens(p.get('predicted'))} |")
    lines += ["", *[f"- {n}" for n in result["notes"]], ""]
    path.write_text("\n".join(lines) + "\n")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--longest", action="store_true", help=argparse.SUPPRESS)  # bench_learner.py's switch
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", default=f"gpu/{datetime.date.today().isoformat()}-longest",
                    help="results path under benchmarks/results, without the suffix")
    ap.add_argument("--dry-run", action="store_true", help="CUDA: the tiny shape up to 16k tokens (seconds)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="learner_gpu.SHAPES names")
    ap.add_argument("--checkpointing", default="off,on", help="learner.activation_checkpointing settings, in order")
    ap.add_argument("--start", type=int, default=4096, help="the search's first length")
    ap.add_argument("--resolution", type=int, default=1024, help="lengths are multiples of this; the warm-up's")
    ap.add_argument("--max-length", type=int, default=131072, help="no longer try")
    ap.add_argument("--time-cap-s", type=float, default=60.0, help="no try starts after this many seconds of tries")
    ap.add_argument("--setting-timeout-s", type=float, default=240.0,
                    help="a setting's process (model made or loaded, warm-up, search) is killed after this")
    ap.add_argument("--budget-s", type=float, default=510.0, help="no setting starts with less than 30 s of it left")
    ap.add_argument("--memory-fraction", type=float, default=1.0,
                    help="CUDA: cap each setting's allocator at this share of the GPU "
                         "(torch.cuda.set_per_process_memory_fraction; 0.56 reads an 80 GB limit on a 141 GB H200)")
    ap.add_argument("--fake-budget-mib", type=float, default=0.0,
                    help="--device cpu: the fake memory, MiB of saved activations")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not 0 < a.memory_fraction <= 1:
        ap.error(f"--memory-fraction {a.memory_fraction}: not in (0, 1]")
    if a.resolution <= PROMPT_TOKENS:
        ap.error(f"--resolution {a.resolution}: the shortest sample must be longer than its {PROMPT_TOKENS}-token prompt")
    if a.device == "cpu" and a.fake_budget_mib <= 0:
        ap.error("--device cpu needs --fake-budget-mib (host memory does not run out in a test)")
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # learner_gpu, beside this file
    if a.child:
        result = measure_setting(a, report=lambda row: print("TRY " + json.dumps(row), flush=True))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    import torch
    from learner_gpu import SHAPES

    if a.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device (torch.cuda.is_available() is False)", flush=True)
        return SKIP_RC
    if a.dry_run:
        a.shapes, a.start, a.max_length, a.time_cap_s, a.setting_timeout_s = "tiny", 2048, 16384, 20.0, 120.0
    shapes, settings = a.shapes.split(","), a.checkpointing.split(",")
    if unknown := [s for s in shapes if s not in SHAPES or SHAPES[s].get("family")]:
        print(f"--shapes: unknown or not dense {unknown}; known: {[s for s in SHAPES if not SHAPES[s].get('family')]}",
              file=sys.stderr)
        return 2
    if bad := [c for c in settings if c not in ("off", "on")]:
        print(f"--checkpointing: {bad} not off or on", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="longest_"))
    cuda = a.device == "cuda"
    result = {"date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": "python benchmarks/bench_learner.py --longest " + " ".join(x for x in argv if x != "--longest"),
              "device_kind": a.device, "device": torch.cuda.get_device_name(0) if cuda else "cpu (fake memory)",
              "cap": f" (allocator capped at {a.memory_fraction:.0%} of it)" if cuda and a.memory_fraction < 1 else "",
              "torch": torch.__version__, "start": a.start, "resolution": a.resolution, "max_length": a.max_length,
              "time_cap_s": a.time_cap_s, "settings": [],
              "notes": ["Every SP > 1 figure is an estimate (token_budget.py's count, scaled to the SP = 1 step); "
                        "SP across GPUs is not run here.",
                        "A length found is a lower bound of the limit within the resolution: tries after a failed "
                        "one run on an allocator the failure may have fragmented."]}
    out = RESULTS / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        fields = {k: v for k, v in SHAPES[shape].items() if k != "family"}
        for ckpt in settings:
            left = a.budget_s - (time.perf_counter() - t_start)
            ns = argparse.Namespace(**{**vars(a), "shape": shape, "checkpointing": ckpt, "model_dir": str(tmp / shape)})
            t = time.perf_counter()
            if left < 30:
                row = {"skipped": f"time budget ({a.budget_s:.0f} s) spent"}
            elif cuda:
                row = run_child(child_command(ns, shape, ckpt, tmp / shape), min(a.setting_timeout_s, left))
            else:
                row = measure_setting(ns)
            row = {"shape": shape, "checkpointing": ckpt, **row}
            row["per_rank"] = per_rank_for(row, fields, cuda=cuda, checkpointing=ckpt == "on", resolution=a.resolution)
            result["settings"].append(row)
            print(f"{shape} checkpointing {ckpt}: longest {row.get('longest', '-')} ({row.get('stopped') or row.get('skipped')}), "
                  f"peak {gib(row.get('peak_bytes'))}, step {row.get('step_s')} [{time.perf_counter() - t:.0f} s]",
                  flush=True)
            if row.get("stderr_tail"):
                print(row["stderr_tail"], file=sys.stderr, flush=True)
            # written after every setting: a run killed later keeps what it measured
            out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
            write_markdown(result, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())
    print(f"wrote {out.with_suffix('.json')} and .md in {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
