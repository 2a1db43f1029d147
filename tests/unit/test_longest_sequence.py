"""`bench_learner.py --longest` (benchmarks/longest_sequence.py) on the CPU: the search over fake predicates,
the per-rank estimate against the CPU measurement of sequence parallelism, and the whole mode on the tiny
shape with a fake memory (autograd's saved bytes, torch.OutOfMemoryError past a small budget)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import longest_sequence as ls  # noqa: E402
from learner_gpu import SHAPES  # noqa: E402

from async_rl.models.shape import ModelShape  # noqa: E402


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def up_to(limit: int, seen: list[int] | None = None):
    def fits(n: int) -> bool:
        if seen is not None:
            seen.append(n)
        return n <= limit

    return fits


def test_monotone_predicate_doubles_then_bisects_to_the_resolution():
    seen: list[int] = []
    s = ls.search_longest(up_to(37_000, seen), start=4096, resolution=1024, max_length=131072, time_cap_s=60)
    assert (s.longest, s.shortest_failed, s.stopped) == (36_864, 37_888, "resolution")
    assert seen[:5] == [4096, 8192, 16384, 32768, 65536]  # doubling until the first failure
    assert all(n % 1024 == 0 for n in seen) and len(seen) == len(set(seen))  # no length tried twice
    assert len(seen) <= 5 + 5  # then log2(32768 / 1024) bisection steps
    assert [t.length for t in s.tries] == seen and [t.fits for t in s.tries] == [n <= 37_000 for n in seen]


def test_the_max_length_ends_the_search_when_everything_fits():
    s = ls.search_longest(lambda n: True, start=4096, resolution=1024, max_length=40_000, time_cap_s=60)
    assert (s.longest, s.shortest_failed, s.stopped) == (40_000, None, "max length")
    assert [t.length for t in s.tries] == [4096, 8192, 16384, 32768, 40_000]


def test_a_first_try_that_fails_halves_down_then_bisects():
    seen: list[int] = []
    s = ls.search_longest(up_to(3000, seen), start=16384, resolution=1024, max_length=131072, time_cap_s=60)
    assert seen[:4] == [16384, 8192, 4096, 2048]
    assert (s.longest, s.shortest_failed, s.stopped) == (2048, 3072, "resolution")
    nothing = ls.search_longest(up_to(500), start=4096, resolution=1024, max_length=8192, time_cap_s=60)
    assert (nothing.longest, nothing.shortest_failed, nothing.stopped) == (0, 1024, "shortest length failed")
    assert [t.length for t in nothing.tries] == [4096, 2048, 1024]


def test_the_time_cap_stops_starting_tries_and_keeps_what_fitted():
    clock = FakeClock()

    def slow(n: int) -> bool:
        clock.now += 10.0  # every try takes 10 s
        return n <= 100_000

    s = ls.search_longest(slow, start=4096, resolution=1024, max_length=131072, time_cap_s=25, clock=clock)
    assert s.stopped == "time cap" and [t.length for t in s.tries] == [4096, 8192, 16384]
    assert s.longest == 16384 and s.shortest_failed is None and all(t.seconds == 10.0 for t in s.tries)


def test_a_predicate_error_that_is_not_memory_propagates_and_bad_bounds_are_refused():
    def broken(n: int) -> bool:
        raise ValueError("a bug, not a memory limit")

    with pytest.raises(ValueError, match="a bug"):
        ls.search_longest(broken, start=4096, resolution=1024, max_length=8192, time_cap_s=60)
    with pytest.raises(ValueError, match="resolution"):
        ls.search_longest(up_to(1), start=512, resolution=1024, max_length=8192, time_cap_s=60)


def test_an_out_of_memory_is_told_from_other_errors():
    assert ls.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert ls.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"))
    assert not ls.is_oom(RuntimeError("shape '[4, 2]' is invalid for input of size 7"))


def test_parameters_are_counted_without_building_and_a_state_too_big_is_named():
    # Qwen2.5's published counts
    assert [ls.dense_params(SHAPES[s]) for s in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")] == [
        494_032_768, 1_543_714_304, 7_615_616_512]
    why = ls.state_fits(SHAPES["qwen2.5-7b"], 80 * 2**30)
    assert why.startswith("does not fit: 7.62B parameters") and "127.7 GiB" in why and "80.0 GiB" in why
    assert ls.state_fits(SHAPES["qwen2.5-7b"], 143_771 * 2**20) is None  # an H200
    assert ls.state_fits(SHAPES["qwen2.5-0.5b"], 80 * 2**30) is None


def test_the_estimate_splits_activations_as_sequence_parallelism_measured_on_cpu():
    """benchmarks/results/sequence_parallel_cpu.json (tiny-qwen2-wide, fp32, gloo): saved activations per
    rank at SP = 2 were 0.52x SP = 1's. The estimate (token_budget's count without its margin) is 1 / SP
    of the tokens, and its SP = 1 bytes are within a few percent of the measured ones."""
    from async_rl.models.tiny import SHAPES as PRESETS

    p = PRESETS["tiny-qwen2-wide"]
    shape = ModelShape(**p._asdict(), vocab_size=64)  # the vocabulary: not in the activations counted
    measured = json.loads((REPO / "benchmarks" / "results" / "sequence_parallel_cpu.json").read_text())["rows"]
    by = {(r["length"], r["sp"]): r["saved_mib"] * 2**20 for r in measured}
    for length in (2048, 8192):
        est = {sp: ls.activation_bytes(shape, length, sp=sp, compute_bytes=4, checkpointing=False, keeps_logits=False,
                                       margin=1.0) for sp in (1, 2)}
        assert est[2] / est[1] == pytest.approx(0.5, abs=1e-3)
        measured_ratio = by[(length, 2)] / by[(length, 1)]
        assert measured_ratio == pytest.approx(0.52, abs=0.01)
        assert abs(est[2] / est[1] - measured_ratio) < 0.05  # what stays whole on every rank: ~2% of SP = 1's
        assert est[1] / by[(length, 1)] == pytest.approx(1.0, abs=0.05)


def test_per_rank_rows_are_scaled_to_the_measured_step():
    shape = msgspec.convert(SHAPES["qwen2.5-1.5b"], ModelShape)
    params = ls.dense_params(SHAPES["qwen2.5-1.5b"])
    kw = dict(compute_bytes=2, checkpointing=True, keeps_logits=True, working_copy=True)
    one = ls.rank_memory(shape, params, 32768, sp=1, parallel="replica", **kw)
    peak = one.state + int(1.3 * one.activations)  # the step took 1.3x the estimate's activations
    rows = ls.per_rank_rows(shape, params, {"longest": 32768, "peak_bytes": peak}, resolution=1024, **kw)
    by = {(r["sp"], r["parallel"]): r for r in rows}
    assert set(by) == {(1, "replica"), (2, "replica"), (2, "fsdp2"), (4, "replica"), (4, "fsdp2")}
    assert all(r["scale"] == pytest.approx(1.3, rel=1e-6) for r in rows)
    assert 31744 <= by[(1, "replica")]["longest_estimate"] <= 32768  # the measured point, back
    assert 4 * 32768 - 4096 <= by[(4, "replica")]["longest_estimate"] <= 4 * 32768  # activations / 4, same state
    assert by[(4, "fsdp2")]["longest_estimate"] > by[(4, "replica")]["longest_estimate"]  # the state sharded too
    assert by[(2, "replica")]["activations"] == pytest.approx(one.activations / 2, rel=1e-6)
    assert by[(4, "fsdp2")]["gradients_optimizer"] == one.gradients_optimizer // 4
    assert all(r["predicted"] is None for r in rows)  # no capacity given
    h200 = ls.per_rank_rows(shape, params, {"longest": 32768, "peak_bytes": peak}, resolution=1024,
                            capacity=140 * 2**30, **kw)
    pred = {(r["sp"], r["parallel"]): r["predicted"] for r in h200}
    assert 0 < pred[(1, "replica")] < pred[(2, "replica")] < pred[(4, "replica")] < pred[(4, "fsdp2")]
    one_rank = ls.rank_memory(shape, params, pred[(1, "replica")], sp=1, parallel="replica", **kw)
    per_token = one_rank.activations / pred[(1, "replica")]
    assert one_rank.total <= 0.9 * 140 * 2**30 < one_rank.total + 1024 * per_token  # the longest within the reserve
    assert ls.per_rank_rows(shape, params, {"longest": 0}, resolution=1024, **kw) == []
    unscaled = ls.per_rank_rows(shape, params, {"longest": 8192, "peak_bytes": None}, resolution=1024, **kw)
    assert unscaled and all(r["longest_estimate"] is None for r in unscaled)


def test_a_shape_not_built_or_not_trained_is_stated_at_the_recipes_length():
    """The 7B shape on an 80 GB GPU is not built: what a rank would hold is stated at 32,768 tokens (the
    long-context recipe's completions), where only FSDP2's sharded state leaves room."""
    fields = SHAPES["qwen2.5-7b"]
    skipped = {"skipped": ls.state_fits(fields, 80 * 2**30), "capacity_bytes": 80 * 2**30,
               "params": ls.dense_params(fields)}
    rows = ls.per_rank_for(skipped, fields, cuda=True, checkpointing=True, resolution=1024)
    by = {(r["sp"], r["parallel"]): r for r in rows}
    assert {r["length"] for r in rows} == {ls.REFERENCE_LENGTH} and all(r["longest_estimate"] is None for r in rows)
    assert by[(1, "replica")]["predicted"] == by[(4, "replica")]["predicted"] == 0  # the state alone is over
    assert by[(4, "fsdp2")]["predicted"] > ls.REFERENCE_LENGTH > by[(2, "fsdp2")]["predicted"] > 0
    assert by[(4, "fsdp2")]["total_bytes"] < 80 * 2**30 < by[(1, "replica")]["total_bytes"]
    assert ls.per_rank_for({"skipped": "time budget spent"}, fields, cuda=True, checkpointing=True,
                           resolution=1024) == []


def test_cpu_smoke_finds_a_limit_under_a_fake_memory_and_trains_again_after_an_out_of_memory(tmp_path):
    out = tmp_path / "smoke"
    rc = ls.main(["--longest", "--device", "cpu", "--shapes", "tiny", "--fake-budget-mib", "32", "--start", "1024",
                  "--resolution", "512", "--max-length", "2048", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.with_suffix(".json").read_text())
    off, on = result["settings"]
    assert (off["checkpointing"], on["checkpointing"]) == ("off", "on")
    # off: 1,024 fits, 2,048 runs out of the fake memory, 1,536 trains after that failure
    assert [(t["length"], t["fits"]) for t in off["tries"]] == [(1024, True), (2048, False), (1536, True)]
    assert (off["longest"], off["shortest_failed"], off["stopped"]) == (1536, 2048, "resolution")
    assert "fake memory" in off["tries"][1]["error"]
    budget = 32 * 2**20
    assert off["peak_bytes"] <= budget and off["step_s"] > 0
    # the fake memory (saved activations) is what the estimate counts, the head's tensors besides
    shape = msgspec.convert(SHAPES["tiny"], ModelShape)
    est = ls.activation_bytes(shape, 1536, sp=1, compute_bytes=4, checkpointing=False, keeps_logits=False, margin=1.0)
    assert 0.9 <= off["peak_bytes"] / est <= 1.5
    # checkpointing keeps one hidden state a layer: the same budget trains the longest length allowed
    assert (on["longest"], on["stopped"]) == (2048, "max length") and on["peak_bytes"] < off["peak_bytes"]
    assert [r["sp"] for r in off["per_rank"]] == [1, 2, 2, 4, 4]
    md = out.with_suffix(".md").read_text()
    assert "| tiny | 1M | off | 1,536 | resolution |" in md and "ESTIMATE, not measured" in md


def test_a_setting_runs_in_its_own_process_and_a_killed_one_keeps_its_tries(tmp_path):
    """The GPU path's process per setting, on the CPU: the child's RESULT line is the row; a child killed at
    its timeout leaves the tries it reported."""
    a = ls.parse(["--device", "cpu", "--fake-budget-mib", "32", "--start", "1024", "--resolution", "512",
                  "--max-length", "1024"])
    row = ls.run_child(ls.child_command(a, "tiny", "off", tmp_path / "tiny"), timeout=240)
    assert "error" not in row, row.get("stderr_tail")
    assert (row["longest"], row["stopped"]) == (1024, "max length") and row["warmup"]["fits"]
    tries = [{"length": 1024, "fits": True, "step_s": 0.5, "peak_bytes": 7, "held_bytes": 3},
             {"length": 2048, "fits": False, "step_s": 0.1, "error": "CUDA out of memory"}]
    code = ("import json, sys, time\n"
            + "".join(f"print('TRY ' + json.dumps({t!r}), flush=True)\n" for t in tries)
            + "print('still searching', file=sys.stderr, flush=True)\ntime.sleep(60)\n")
    killed = ls.run_child([sys.executable, "-c", code], timeout=5)
    assert killed["stopped"] == "killed after 5 s: still searching" and killed["tries"] == tries
    assert (killed["longest"], killed["shortest_failed"], killed["peak_bytes"]) == (1024, 2048, 7)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the benchmark would run")
def test_without_cuda_the_gpu_mode_skips_with_exit_3():
    out = "gpu/contract-check-longest"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_learner.py"), "--longest", "--device", "cuda", "--out", out,
         "--dry-run"], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("SKIP: ")
    assert not (REPO / "benchmarks" / "results" / f"{out}.json").exists()
