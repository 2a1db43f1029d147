"""The local spec's core attention through torch's kernels (`learner.megatron.attention`): sdpa
(the backend's masks, additive) and varlen (packed micro-batches as one row with their bounds, the CPU
reference of varlen flash attention) against megatron's `DotProductAttention`, in fp32 on two gloo ranks with TP=2:
per-token log-probs (max abs < 1e-5) and every parameter's gradient (relative < 1e-4) of packed and
padded micro-batches; a micro-batch adds no host read (sync) to a step with the local and sdpa kernels.
One spawn for the module; the kernels are swapped into the same model, so the
weights are the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.cluster.net import free_port  # noqa: E402
from async_rl.learner.megatron.attention import resolve  # noqa: E402
from tests.unit._megatron_attention_ranks import KERNELS, run_attention_rank  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    import torch.multiprocessing as mp

    from async_rl.models.tiny import resolve_model_path

    model_dir = resolve_model_path("tiny-qwen2", str(tmp_path_factory.mktemp("models")))
    out = tmp_path_factory.mktemp("attention")
    mp.spawn(run_attention_rank, args=(2, free_port(), str(model_dir), str(out)), nprocs=2, join=True)
    return {r: torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(2)}


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k != "local"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_kernel_equals_the_local_spec(ranks, kernel, layout):
    for r, got in ranks.items():
        ref, new = got["local"][layout], got[kernel][layout]
        mask = got["loss_mask"][layout].bool()
        diff = (new["logp"] - ref["logp"]).abs()[mask].max()
        assert diff < 1e-5, (r, diff)
        assert len(new["grads"]) == len(ref["grads"]) > 0
        for a, b in zip(new["grads"], ref["grads"], strict=True):
            rel = (a - b).norm() / b.norm().clamp_min(1e-12)
            assert rel < 1e-4, (r, rel)


@pytest.mark.parametrize("kernel", ["local", "sdpa"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_micro_batch_adds_no_host_read(ranks, kernel, layout):
    """Host reads per step (tests/unit/_host_reads.py, the proxy for CUDA syncs) do not grow with the
    micro-batches: the masks are built where the model runs and the head's positions come indexed
    from the host (before: one `nonzero` per micro-batch). varlen is left out: its CPU reference reads
    the cumulative lengths (`tolist`) to cut its per-sequence SDPA."""
    for got in ranks.values():
        (one, reads_one), (many, reads_many) = got["reads"][kernel][layout]
        assert many > one
        assert reads_many - reads_one <= 0, got["reads"][kernel][layout]


def test_varlen_rotates_a_packed_row_whole(ranks):
    """varlen gets a packed micro-batch as one row with its bounds, not as THD, whose RoPE without
    Transformer Engine runs sequence by sequence after a host read, in every layer."""
    for got in ranks.values():
        assert got["thd_rope"]["varlen"] == {"packed": 0, "padded": 0}, got["thd_rope"]


def test_shared_prompts_through_the_varlen_row_equal_the_unshared_layout(ranks):
    """`learner.share_prompt` with megatron's varlen row: each suffix reads its prefix through the
    layout's key index and is rotated by its own position ids (`megatron.rotary`), so every sequence
    scores as when it carries its prompt, and the gradients are the same; in fewer tokens. The sdpa
    kernel (the block-diagonal mask from position ids) takes no shared prompts."""
    for r, got in ranks.items():
        shared, unshared = got["shared"]["shared"], got["shared"]["unshared"]
        assert got["shared"]["takes"] == {"sdpa": False, "varlen": True}
        assert shared["shares"] and not unshared["shares"]
        assert shared["tokens"] < unshared["tokens"], (shared["tokens"], unshared["tokens"])
        assert len(shared["logp"]) == len(unshared["logp"]) == 6
        for a, b in zip(shared["logp"], unshared["logp"], strict=True):
            assert a.shape == b.shape and abs(a - b).max() < 1e-5, (r, abs(a - b).max())
        assert len(shared["grads"]) == len(unshared["grads"]) > 0
        for a, b in zip(shared["grads"], unshared["grads"], strict=True):
            rel = (a - b).norm() / b.norm().clamp_min(1e-12)
            assert rel < 1e-4, (r, rel)
        # a dummy micro-batch (no position ids, no loss) after the row ones runs as rows and adds nothing
        for a, b in zip(got["shared"]["with_dummy"], shared["grads"], strict=True):
            assert torch.equal(a, b)


def test_the_local_spec_is_replaced(ranks):
    for got in ranks.values():
        assert got["spec"] == {"local": {"DotProductAttention"}, "sdpa": {"TorchCoreAttention"}, "varlen": {"TorchCoreAttention"}}


def test_setting_resolves():
    assert resolve("auto", "cuda", torch.bfloat16) == "varlen"
    assert resolve("auto", "cuda", torch.float16) == "varlen"
    assert resolve("auto", "cuda", torch.float32) == "sdpa"  # flash attention takes no fp32
    assert resolve("auto", "cpu", torch.bfloat16) == "sdpa"
    assert resolve("local", "cpu", torch.float32) == "local"
    assert resolve("varlen", "cpu", torch.float32) == "varlen"
    with pytest.raises(ValueError, match="varlen on CUDA needs model.dtype"):
        resolve("varlen", "cuda", torch.float32)
