"""learner.sequence_parallel_size (Ulysses, learner/model/ulysses.py) on CPU over gloo: SP = 2, SP = 4
(GQA: the tiny model's 2 K/V heads repeated) and DP = 2 x SP = 2 give SP = 1's log-probs, entropies,
scoring passes (log-probs and hidden states), gradients and whole learner step, on packed rows,
shared prompts, multi-turn loss masks and padded rows, with LoRA and a KL reference, and ppo's critic;
the parameters equal on every rank of an SP group, and a checkpoint the SP ranks write (DDP and FSDP2)
loaded by one plain rank with those parameters; and the one-line refusals."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from async_rl.cluster.net import free_port
from async_rl.config import AlgorithmConfig, LoraConfig
from async_rl.learner.driver import LearnerDriver
from async_rl.learner.model.ulysses import check, kv_repeat
from tests.unit._learner_fixtures import assert_equal_steps, episode_groups, groups, settings, spied_step

# name -> (learner settings, the shard's groups); the settings cut micro-batches into several packed
# rows and several micro-batches, so row boundaries and the SP slice boundaries fall anywhere
CASES = {
    "packed": ({"share_prompt": False, "pack_row_tokens": 16, "micro_batch_tokens": 40}, "plain"),
    "shared_multiturn": ({"share_prompt": True, "micro_batch_tokens": 48}, "episodes"),
    "padded": ({"packing": False, "share_prompt": False}, "episodes"),
    # one sequence a micro-batch: every row one causal sequence, SDPA's is_causal without a mask
    "one_a_row": ({"share_prompt": False, "micro_batch_size": 1}, "plain"),
    # the varlen layout (on CPU its per-segment reference) of shared-prompt blocks inside the exchange
    "varlen_shared": ({"attention": "varlen", "share_prompt": True, "micro_batch_tokens": 48}, "episodes"),
    # LoRA, its frozen base as the KL reference, a KL loss term; the reference runs whole sequences, the SP
    # ranks of a group each scoring a share of the shard's micro-batches
    "lora_kl": ({"lora": LoraConfig(enabled=True, rank=4, init="gaussian"), "algorithm": AlgorithmConfig(kl_coef=0.1),
                 "micro_batch_tokens": 48}, "episodes"),
    # FSDP2: sharded over all four ranks of DP x SP (the reference: one plain rank)
    "fsdp2": ({"parallel": "fsdp2", "share_prompt": False, "pack_row_tokens": 16, "micro_batch_tokens": 40}, "plain"),
    # full fine-tuning with a KL penalty: the reference is a loaded copy of the initial weights
    "kl": ({"algorithm": AlgorithmConfig(kl_coef=0.1), "micro_batch_tokens": 48}, "plain"),
    # ppo: the critic reads the policy's hidden states, gathered over the SP group
    "ppo": ({"algorithm": AlgorithmConfig(name="ppo"), "micro_batch_tokens": 40}, "plain"),
}


WITH_REFERENCE = ("lora_kl", "kl")


def _count_reference_rows() -> list[int]:
    """The rows of each micro-batch the KL reference pass scores in this process, from now on (it
    calls `model_scores` once a micro-batch). The list is cleared by the caller between cases."""
    from async_rl.learner.rl import reference

    rows: list[int] = []
    inner = reference.model_scores

    def counted(model, inputs, *args, **kwargs):
        rows.append(int(inputs["input_ids"].shape[0]))
        return inner(model, inputs, *args, **kwargs)

    reference.model_scores = counted
    return rows


def shard(kind: str, dp_rank: int) -> list:
    seed = 7 + dp_rank
    return groups(seed, n_groups=3, group_size=3) if kind == "plain" else episode_groups(seed, n_groups=2)


CHECKPOINTED = ("packed", "fsdp2")  # saved after the step, then loaded into one plain rank


def _full(tensors: dict) -> dict:
    """Plain tensors (FSDP2's DTensor shards gathered: a collective, the same names in the same order on
    every rank)."""
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for n, t in tensors.items()}


def _rank(rank: int, world: int, sp: int, ports: list[int], model_dir: str, out: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    reference_rows = _count_reference_rows()  # a spawned process of its own: patched for its life
    for case, port in zip(cases, ports, strict=True):
        reference_rows.clear()
        learner, kind = CASES[case]
        torch.manual_seed(0)
        driver = LearnerDriver(settings(model_dir, sequence_parallel_size=sp, **learner), rank, world,
                               f"127.0.0.1:{port}", [])
        driver.setup()
        assert driver.backend.info.dp_rank == rank // sp and driver.backend.info.dp_size == world // sp
        result = spied_step(driver, shard(kind, rank // sp))
        result.pop("mbs")
        result["grads"] = _full(result["grads"])
        result["params"] = _full(dict(driver.backend.model.named_parameters()))
        result["reference_rows"] = sum(reference_rows)
        torch.save(result, f"{out}/{case}_{rank}.pt")
        if case in CHECKPOINTED:  # every rank takes part, as in a run; rank 0 writes the model
            ckpt = Path(out) / f"checkpoint_{case}"
            ckpt.mkdir(exist_ok=True)
            driver.save_checkpoint(str(ckpt))
        driver.shutdown()


def _one_rank(model_dir, case: str) -> LearnerDriver:
    """A plain rank (SP = 1, world 1) with the case's settings, set up. One rank: DDP's step is FSDP2's."""
    learner = {k: v for k, v in CASES[case][0].items() if k != "parallel"}
    driver = LearnerDriver(settings(model_dir, **learner), 0, 1, "", [])
    driver.setup()
    return driver


def _reference(model_dir, case: str, dp: int) -> dict:
    """SP = 1 on one rank, over the DP ranks' shards together (the loss is the global token mean, so
    one rank on their union has their summed gradient)."""
    torch.manual_seed(0)
    driver = _one_rank(model_dir, case)
    union = [g for d in range(dp) for g in shard(CASES[case][1], d)]
    result = spied_step(driver, union)
    result["params"] = {n: p.detach().clone() for n, p in driver.backend.model.named_parameters()}
    driver.shutdown()
    return result


def _joined(parts: list[dict]) -> dict:
    """The DP ranks' results as one rank's over their shards together (gradients and parameters are
    every rank's already)."""
    first = parts[0]
    # the controller's loss: the ranks' mean (each is its share of the global token mean x DP); the
    # other statistics are each rank's means over its loss tokens (completion tokens less the environment's)
    loss = float(np.mean([p["metrics"].loss for p in parts]))
    tokens = np.array([p["metrics"].tokens - p["metrics"].env_tokens for p in parts], dtype=np.float64)  # loss tokens
    weighted = {f: float(np.dot([getattr(p["metrics"], f) for p in parts], tokens) / tokens.sum())
                for f in ("kl_behav", "logprob_abs_diff", "entropy", "cov_frac", "value_loss")}
    scored = [p["scored"] for p in parts]
    width = max(s[0].shape[1] for s in scored)

    def pad(t: torch.Tensor) -> torch.Tensor:
        extra = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
        return torch.nn.functional.pad(t, extra)

    return {
        "logp": [x for p in parts for x in p["logp"]],
        "entropy": [x for p in parts for x in p["entropy"]],
        "scored": (torch.cat([pad(s[0]) for s in scored]), torch.cat([pad(s[1]) for s in scored])),
        "mask": torch.cat([pad(p["mask"]) for p in parts]),
        "grads": first["grads"],
        "params": first["params"],
        "metrics": msgspec.structs.replace(first["metrics"], loss=loss, **weighted),
        "loss": loss,
    }


def _resumes_exactly(model_dir, case: str, checkpoint: Path, params: dict) -> None:
    driver = _one_rank(model_dir, case)
    assert driver.load_checkpoint(str(checkpoint)) == 1
    loaded = dict(driver.backend.model.named_parameters())
    assert all(torch.equal(loaded[n].detach(), p) for n, p in params.items()), case
    driver.shutdown()


def _run(model_dir, tmp_path, world: int, sp: int, cases: list[str], atol: float = 1e-5) -> None:
    ports = [free_port() for _ in cases]
    mp.spawn(_rank, args=(world, sp, ports, str(model_dir), str(tmp_path), cases), nprocs=world, join=True)
    dp = world // sp
    for case in cases:
        ranks = [torch.load(tmp_path / f"{case}_{r}.pt", weights_only=False) for r in range(world)]
        ref = _reference(model_dir, case, dp)
        for d in range(dp):  # the SP ranks of a group agree with each other exactly where they computed alike
            group = ranks[d * sp : (d + 1) * sp]
            for other in group[1:]:
                assert other["metrics"].loss == group[0]["metrics"].loss
                assert other["metrics"].samples == 0 and group[0]["metrics"].samples > 0  # counted once
                # the parameters after the step are the same on every rank of the group (checkpoints and
                # the weight sync read rank 0's)
                assert all(torch.equal(other["params"][n], p) for n, p in group[0]["params"].items()), case
        if case in WITH_REFERENCE and sp > 1:  # the reference pass shared, not repeated, over each SP group
            for d in range(dp):  # every row of the DP rank's shard scored once, by one SP rank, each some
                rows = [r["reference_rows"] for r in ranks[d * sp : (d + 1) * sp]]
                assert sum(rows) == sum(len(g.completions) for g in shard(CASES[case][1], d)), (case, rows)
                assert all(n > 0 for n in rows), (case, rows)
        if case in CHECKPOINTED:  # a checkpoint of SP ranks is any run's: one plain rank resumes from it
            _resumes_exactly(model_dir, case, tmp_path / f"checkpoint_{case}", ranks[0]["params"])
        got = _joined([ranks[d * sp] for d in range(dp)])
        assert_equal_steps(ref, got, atol)
        assert got["loss"] == pytest.approx(ref["metrics"].loss, rel=1e-5, abs=1e-7), case
        assert got["metrics"].grad_norm == pytest.approx(ref["metrics"].grad_norm, rel=1e-5), case
        for name, p in ref["params"].items():  # the whole step: AdamW from equal gradients (lr 1e-2)
            # AdamW's first update is lr * g / (|g| + 1e-8): where a gradient is about eps, fp32 rounding of
            # g (1e-9 against 1e-9) moves it by up to lr; elsewhere it is g's sign times lr, equal
            sure = ref["grads"][name].abs() > 1e-6 if name in ref["grads"] else torch.ones_like(p, dtype=torch.bool)
            diff = (got["params"][name] - p).abs()
            assert float(torch.where(sure, diff, 0).max()) < 1e-5 and float(diff.max()) <= 2e-2, f"{case}: {name}"


def test_sp2_equals_sp1_on_packed_shared_multiturn_padded_lora_kl_and_ppo(model_dir, tmp_path):
    _run(model_dir, tmp_path, world=2, sp=2, cases=[c for c in CASES if c != "fsdp2"])


def test_sp4_with_repeated_kv_heads_equals_sp1(model_dir, tmp_path):
    # the tiny model: 4 query heads, 2 K/V heads; SP = 4 repeats each K/V head twice
    assert kv_repeat(4, 2) == 2
    _run(model_dir, tmp_path, world=4, sp=4, cases=["shared_multiturn"])


def test_dp2_x_sp2_equals_one_rank_on_both_shards(model_dir, tmp_path):
    # DDP and FSDP2 on packed rows; multi-turn masks with LoRA and the KL reference; ppo's critic
    _run(model_dir, tmp_path, world=4, sp=2, cases=["packed", "fsdp2", "lora_kl", "ppo"])


def _first_layers(model_dir: Path, layers: int, out: Path) -> Path:
    """A copy of the model at `model_dir` with only its first `layers` decoder layers (its real weights,
    embeddings, final norm and tokenizer): the same head layout at a fraction of the compute."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(model_dir, num_hidden_layers=layers, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def test_sp3_on_smollm2_real_weights_equals_sp1(smollm2, tmp_path):
    # SmolLM2-135M's real weights and head layout, 9 query heads and 3 K/V heads: one K/V head and 3 query
    # heads a rank. Its first 4 of 30 layers: the whole model took 75 s of the unit tier (the split is per
    # layer, so a deeper stack checks nothing more). Each rank's matmuls see a third of the rows (other GEMM
    # blockings, other fp32 rounding): log-probs differ in the last bits
    model = _first_layers(smollm2, 4, tmp_path / "smollm2_4_layers")
    _run(model, tmp_path, world=3, sp=3, cases=["shared_multiturn"], atol=1e-4)


def test_heads_and_world_that_sp_cannot_split_are_refused_in_one_line():
    assert check(2, 4, 4) is None
    assert "world_size=3" in check(2, 3, 4)
    assert "9 attention heads" in check(2, 2, 9)  # SmolLM2 at SP = 2
    assert check(3, 3, 9) is None and kv_repeat(3, 3) == 1  # SmolLM2 at SP = 3: one K/V head each
    assert kv_repeat(4, 2) == 2 and kv_repeat(8, 1) == 8 and kv_repeat(4, 6) == 2


def test_a_sample_longer_than_max_model_len_stops_the_step_in_one_line():
    from async_rl.errors import RunError
    from async_rl.learner.driver import check_lengths

    gs = groups(3, n_groups=2, group_size=2)
    longest = max(len(g.prompt_tokens) + len(c) for g in gs for c in g.completions)
    check_lengths(gs, longest)
    with pytest.raises(RunError, match=r"generators.max_model_len=") as info:
        check_lengths(gs, longest - 1)
    assert "\n" not in str(info.value) and "prompt " in str(info.value)
