"""The hand-written Triton statistics kernel (learner/model/head_triton.py, `learner.head_kernel: triton`) on
the CPU, under Triton's interpreter: the same (log p, log-sum-exp, entropy) as `head_fused.chunk_stats`
run as written, and the chunked head with it the same values and gradients as the eager head.

TRITON_INTERPRET must be set before the kernel is built, and another test in the same process (an
inductor compile, Liger) may have imported triton or built kernels already: the interpreter checks run
in a fresh Python (this file run as a module, the fixture `interpreted`), with a small BLOCK so that rows span
several blocks and end in a partial one. The error for a machine that cannot run the kernel is checked
in this process.

The interpreter says nothing of the GPU build: `check_hopper_build` compiles the kernel ahead of time for
an H100/H200 (sm_90) with the installed Triton and its own ptxas, no GPU needed, in a fresh Python
without the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from async_rl.errors import RunError
from async_rl.learner.model import head_fused, head_triton

ROOT = Path(__file__).resolve().parents[2]


CHECKS = ("check_stats", "check_head", "check_autotune")


def run_fresh(checks: tuple[str, ...], interpreter: bool, timeout_s: float) -> str:
    """The output of `checks` (this file's check functions) run in one fresh Python, under Triton's
    interpreter or without it: a line `<check> ok` for each that passed, its traceback for each that failed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpreter:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "tests.unit.test_head_triton", *checks], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    return f"rc {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"


@pytest.fixture(scope="module")
def interpreted() -> str:
    """Every interpreter check below, run in one fresh Python under Triton's interpreter (one torch import for all)."""
    return run_fresh(CHECKS, interpreter=True, timeout_s=180)


def assert_passed(output: str, check: str) -> None:
    assert f"{check} ok" in output.splitlines(), f"{check} failed in its fresh Python:\n{output[-6000:]}"


def reference64(z: torch.Tensor, targets: torch.Tensor, temperature: float):
    """(log p, lse, entropy) in float64: what both fp32 versions round."""
    zf = z.double() / temperature
    lse = torch.logsumexp(zf, -1)
    p = torch.softmax(zf, -1)
    return zf.gather(-1, targets[:, None]).squeeze(-1) - lse, lse, lse - (p * zf).sum(-1)


def check_stats() -> None:
    import async_rl.learner.model.head  # noqa: F401  (the head imports no triton either)

    assert "triton" not in sys.modules, "importing head_triton or the head imported triton"
    head_triton.BLOCK = 256
    torch.manual_seed(0)
    big = 3 * torch.randn(3, 1200)
    cases = [3 * torch.randn(1, 1000), 3 * torch.randn(5, 1000), 3 * torch.randn(2, 256), 3 * torch.randn(4, 7),
             big[:, :1000]]  # one row; V not a multiple of BLOCK, a multiple, below one block; rows strided
    for z in cases:
        for dtype in (torch.float32, torch.bfloat16):
            zd = z.to(dtype) if dtype != z.dtype else z  # bf16 logits are exact in fp32: the same fp32 arithmetic
            targets = torch.randint(0, z.shape[1], (z.shape[0],))
            targets[0] = z.shape[1] - 1  # the last column, in the partial block
            for temperature in (1.0, 0.7):
                for with_entropy in (True, False):
                    got = head_triton.chunk_stats(zd, targets, temperature, with_entropy)
                    want = head_fused.chunk_stats(zd, targets, temperature, with_entropy)
                    where = f"{tuple(z.shape)} {dtype} t={temperature} entropy={with_entropy}"
                    assert (got[2] is None) == (not with_entropy), where
                    for g, w in zip(got, want, strict=True):
                        if w is None:
                            continue
                        assert g.dtype == torch.float32 and g.shape == w.shape, where
                        torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=lambda m, where=where: f"{where}: {m}")
    # Extreme logits: the running max jumps by ~160 between blocks (the sums rescaled by exp(-160 / t)),
    # a row is a linear ramp, one sits near +80 everywhere, one has its top 100 columns tied in the
    # last blocks. |z/t| reaches 230, where one fp32 step is 1.5e-5: compared with float64, and with
    # the eager fp32 code within that step.
    z = 0.1 * torch.randn(5, 1000)
    z[:, 700], z[:, 10] = 80.0, -80.0
    z[1] = torch.linspace(-80, 80, 1000)
    z[2] = 80 + torch.randn(1000)
    z[3, 900:] = 80.0
    z[4, :300], z[4, 300:] = -80.0, torch.linspace(-80, 80, 700).flip(0)
    targets = torch.tensor([700, 999, 3, 10, 0])
    for temperature in (1.0, 0.7):
        got = head_triton.chunk_stats(z, targets, temperature, True)
        want = head_fused.chunk_stats(z, targets, temperature, True)
        for name, g, w, r in zip(("logp", "lse", "entropy"), got, want, reference64(z, targets, temperature),
                                 strict=True):
            assert torch.isfinite(g).all(), (name, g)
            torch.testing.assert_close(g.double(), r, atol=2e-5, rtol=0, msg=lambda m, n=name: f"{n} vs f64: {m}")
            torch.testing.assert_close(g, w, atol=2e-5, rtol=0, msg=lambda m, n=name: f"{n} vs eager: {m}")
    empty = head_triton.chunk_stats(torch.zeros(0, 50), torch.zeros(0, dtype=torch.long), 1.0, True)
    assert [t.shape for t in empty] == [(0,)] * 3


def check_head() -> None:
    from tests.unit.test_head_fused import run_head

    head_triton.BLOCK = 32  # the test's 97-token vocabulary: three blocks and a partial one
    head_fused.compiled = lambda: head_fused.EAGER  # the backward's chunk_grad as written: no inductor compile
    assert head_fused.fused_setting("triton", "cpu") == "triton"
    for temperature in (1.0, 0.7):
        eager = run_head(False, temperature, True, True)
        fused = run_head("triton", temperature, True, True)
        for a, b in zip(eager[:2], fused[:2], strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        for a, b in zip(eager[2:], fused[2:], strict=True):  # gradients, relative
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)
    eager = run_head(False, 0.7, False, False, with_entropy=False)
    fused = run_head("triton", 0.7, False, False, with_entropy=False)
    assert eager[1] is None and fused[1] is None
    torch.testing.assert_close(fused[0], eager[0], atol=1e-5, rtol=0)
    eager = run_head(False, 1.0, True, True, dtype=torch.bfloat16)
    fused = run_head("triton", 1.0, True, True, dtype=torch.bfloat16)
    torch.testing.assert_close(fused[0], eager[0], atol=1e-5, rtol=0)  # the same bf16 logits, fp32 arithmetic
    torch.testing.assert_close(fused[1], eager[1], atol=1e-5, rtol=0)
    assert fused[2].dtype == fused[3].dtype == torch.bfloat16
    # megatron's head on one TP rank (the whole vocabulary): "triton" runs the same statistics kernel
    from async_rl.learner.megatron.head import VocabShard, chunked_scores

    out = {}
    for fused in (False, "triton"):
        torch.manual_seed(2)
        hidden, weight = torch.randn(29, 16, requires_grad=True), (0.3 * torch.randn(97, 16)).requires_grad_()
        logp, entropy = chunked_scores(hidden, weight, torch.randint(0, 97, (29,)), 0.7, 8,
                                       VocabShard.of(97, 97, 0, None), True, fused)
        ((logp * torch.randn(29)).sum() + (entropy * torch.randn(29)).sum()).backward()
        out[fused] = (logp, entropy, hidden.grad, weight.grad)
    for a, b in zip(out[False], out["triton"], strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def check_autotune() -> None:
    """The autotuned build that CUDA runs (`build(autotuned=True)`), its timer a CPU clock: every config
    is timed on the first call for a vocabulary, the fastest kept and named by `tuned()`, the results
    the eager statistics' whichever config ran; a second vocabulary is tuned again, a second call for
    the same one is not."""
    import functools
    import time

    head_triton.CONFIGS = ((64, 4), (128, 4), (256, 8))
    timed: list[int] = []

    def cpu_bench(kernel_call, quantiles):
        t = time.perf_counter()
        kernel_call()
        timed.append(1)
        return [time.perf_counter() - t] * len(quantiles)

    head_triton._kernel = functools.cache(lambda: head_triton.build(autotuned=True, do_bench=cpu_bench))
    assert head_triton.tuned() is None  # nothing built yet
    torch.manual_seed(1)
    for vocab, tunings in ((1000, 3), (1000, 3), (300, 6)):
        z, targets = 3 * torch.randn(4, vocab), torch.randint(0, vocab, (4,))
        got = head_triton.chunk_stats(z, targets, 0.7, True)
        for g, w in zip(got, head_fused.chunk_stats(z, targets, 0.7, True), strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
        assert len(timed) == tunings, (vocab, len(timed))
        assert head_triton._kernel()[1]
        assert head_triton.tuned() in {f"BLOCK {b}, {w} warps" for b, w in head_triton.CONFIGS}


# The kernel's arguments as Triton's launcher types them on CUDA, and the specialisation it gives them there:
# torch's allocations (and rows of V % 8 == 0 bf16 logits) start 16-byte aligned, and Qwen2.5's stride and
# vocabulary (151,936) are multiples of 16, so the launcher marks those arguments divisible by 16.
SIGNATURE = {"z_ptr": "*bf16", "stride": "i64", "targets_ptr": "*i64", "logp_ptr": "*fp32", "lse_ptr": "*fp32",
             "entropy_ptr": "*fp32", "vocab": "i32", "temperature": "fp32", "WITH_ENTROPY": "constexpr",
             "BLOCK": "constexpr"}
ALIGNED = ("z_ptr", "stride", "targets_ptr", "logp_ptr", "lse_ptr", "entropy_ptr", "vocab")


def check_hopper_build() -> None:
    """Every autotuner config of `head_triton.CONFIGS` builds for sm_90 for bf16 and fp32 logits, with and
    without the entropy; for each of those, one config at least keeps its loop in registers (no stack
    frame: nothing spilled to local memory), and the bf16 logits are read 128 bits at a time (the
    memory-bound kernel's loads vectorised). Registers and stack are read from the cubin with the
    cuobjdump Triton ships beside its ptxas."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert "TRITON_INTERPRET" not in os.environ
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    kernel, autotuned = head_triton.build(autotuned=False)
    assert not autotuned
    names = list(SIGNATURE)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    spill_free: dict[tuple[str, bool], list[tuple[int, int]]] = {}
    for dtype in ("bf16", "fp32"):
        for with_entropy in (True, False):
            spill_free[dtype, with_entropy] = []
            for block, warps in head_triton.CONFIGS:
                source = ASTSource(kernel, {**SIGNATURE, "z_ptr": f"*{dtype}"},
                                   constexprs={"WITH_ENTROPY": with_entropy, "BLOCK": block}, attrs=attrs)
                built = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
                cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"head_stats_{os.getpid()}.cubin"
                cubin.write_bytes(built.asm["cubin"])
                usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True,
                                       check=True).stdout
                cubin.unlink()
                stack = re.search(r"STACK:(\d+)", usage)
                assert stack, usage
                if int(stack.group(1)) == 0:
                    spill_free[dtype, with_entropy].append((block, warps))
                if dtype == "bf16":
                    assert "ld.global.v4.b32" in built.asm["ptx"], (block, warps, "bf16 logits not read 128 bits at a time")
    assert all(spill_free.values()), spill_free
    print("spill-free configs:", spill_free)


@pytest.fixture(scope="module")
def hopper_build() -> str:
    """`check_hopper_build`, run in a fresh Python without the interpreter."""
    return run_fresh(("check_hopper_build",), interpreter=False, timeout_s=300)


def test_the_kernel_builds_for_hopper_without_spilling_and_with_vector_loads(hopper_build):
    assert_passed(hopper_build, "check_hopper_build")


def test_triton_statistics_equal_the_eager_statistics(interpreted):
    assert_passed(interpreted, "check_stats")


def test_the_chunked_head_with_triton_statistics_equals_the_eager_head(interpreted):
    assert_passed(interpreted, "check_head")


def test_the_autotuned_kernel_times_every_config_once_per_vocabulary(interpreted):
    assert_passed(interpreted, "check_autotune")


def test_triton_without_cuda_or_the_interpreter_is_a_one_line_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RunError, match=r"^learner\.head_kernel=triton: .*CUDA") as e:
        head_fused.fused_setting("triton", "cpu")
    assert "\n" not in str(e.value)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)  # triton not importable
    with pytest.raises(RunError, match=r"^learner\.head_kernel=triton: triton does not import"):
        head_fused.fused_setting("triton", "cuda")


def test_auto_and_the_other_settings_are_unchanged():
    assert [head_fused.fused_setting(s, d) for s in ("auto", "compiled", "eager") for d in ("cpu", "cuda")] == [
        False, True, True, True, False, False]


if __name__ == "__main__":
    import traceback

    failed = False
    for name in sys.argv[1:]:
        try:
            {"check_stats": check_stats, "check_head": check_head, "check_autotune": check_autotune,
             "check_hopper_build": check_hopper_build}[name]()
            print(f"{name} ok", flush=True)
        except Exception:
            failed = True
            print(f"{name} FAILED\n{traceback.format_exc()}", flush=True)
    sys.exit(1 if failed else 0)
