"""Megatron backend on one GPU (nccl, world size 1, TP=PP=1): log-probs match the HF model, megatron's
optimizer (distributed and not) lowers the loss in a few steps, export matches what was trained; the backend with
Transformer Engine (packed as THD), and with varlen flash attention (packed as one row), scores packed sequences as
padded ones; Qwen3-MoE with megatron's all-to-all dispatcher (and TE's grouped experts) matches HF, replay included.
Marked `gpu` by tests/gpu/conftest.py; skipped without CUDA or without megatron-core."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[gpu]')")

from async_rl.learner.megatron import convert as mcv  # noqa: E402
from async_rl.learner.megatron import model as mm  # noqa: E402
from async_rl.learner.megatron.learner import MegatronPolicy  # noqa: E402
from async_rl.learner.rl.algorithms import token_logprobs  # noqa: E402
from tests.gpu._gpu_util import free_port, model_dir_or_skip  # noqa: E402
from tests.unit._megatron_models import fixed_batch, on_policy_loss, tiny_llama, tiny_qwen2  # noqa: E402

MODELS = {"qwen2": tiny_qwen2, "llama": tiny_llama}


@pytest.fixture(scope="module")
def model_parallel():
    from megatron.core import parallel_state, tensor_parallel

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons below mean fp32
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def make_policy(hf, distributed_optimizer: bool, dtype=torch.float32, te_spec: bool = False, lr: float = 3e-3):
    arch = mcv.arch_from_hf_config(hf.config)
    return MegatronPolicy(
        arch,
        dict(hf.named_parameters()),
        dtype=dtype,
        lr=lr,
        weight_decay=0.0,
        max_grad_norm=1.0,
        distributed_optimizer=distributed_optimizer,
        te_spec=te_spec,
        cpu_init=False,
    )


def hf_logprobs(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(hf(input_ids=ids).logits[:, :-1], ids[:, 1:])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_megatron_logprobs_match_hf_on_gpu(model_parallel, name):
    hf = MODELS[name]().cuda().eval()
    policy = make_policy(hf, distributed_optimizer=True)
    ids = torch.randint(0, hf.config.vocab_size, (4, 33), device="cuda")
    got = policy.logprobs(ids)
    ref = hf_logprobs(hf, ids)
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()


def test_transformer_engine_spec_matches_hf_when_available(model_parallel):
    if not mm.transformer_engine_available():
        pytest.skip("transformer_engine is not importable")
    hf = tiny_qwen2().cuda().eval()
    policy = make_policy(hf, distributed_optimizer=False, te_spec=True)
    exported = policy.hf_state_dict()
    for n, t in hf.named_parameters():
        assert torch.equal(exported[n], t), n
    ids = torch.randint(0, hf.config.vocab_size, (2, 17), device="cuda")
    got, ref = policy.logprobs(ids), hf_logprobs(hf, ids)
    assert torch.allclose(got, ref, atol=1e-3, rtol=0), (got - ref).abs().max()


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_megatron_optimizer_steps_lower_the_loss(model_parallel, distributed_optimizer):
    hf = tiny_qwen2().cuda()
    policy = make_policy(hf, distributed_optimizer=distributed_optimizer)
    b = fixed_batch(hf.config.vocab_size)
    b.behav_logp = policy.logprobs(b.input_ids).cpu() * b.loss_mask
    losses = []
    for _ in range(4):
        stats, grad_norm = policy.train_batch(b, 2, 1.0, 0.2, 0.2, 2.0)
        losses.append(stats.loss)
        assert grad_norm > 0
    assert abs(losses[0] - on_policy_loss(b)) < 1e-4
    assert losses[-1] < losses[0] - 1e-3, losses
    after = policy.logprobs(b.input_ids)
    hf.load_state_dict(policy.hf_state_dict(), strict=False)
    ref = hf_logprobs(hf.eval(), b.input_ids.cuda())
    assert torch.allclose(after, ref, atol=1e-4), (after - ref).abs().max()


def test_bf16_policy_trains_and_stays_close_to_hf(model_parallel):
    hf = tiny_qwen2().cuda()
    policy = make_policy(hf, distributed_optimizer=True, dtype=torch.bfloat16)
    b = fixed_batch(hf.config.vocab_size)
    ref = hf_logprobs(hf.eval(), b.input_ids.cuda())
    got = policy.logprobs(b.input_ids)
    assert (got - ref).abs().mean() < 2e-2  # bf16 weights and activations
    b.behav_logp = got.cpu() * b.loss_mask
    first, _ = policy.train_batch(b, 1, 1.0, 0.2, 0.2, 2.0)
    for _ in range(3):
        last, _ = policy.train_batch(b, 1, 1.0, 0.2, 0.2, 2.0)
    assert last.loss < first.loss


def test_megatron_tp1_bf16_on_smollm2_matches_hf(model_parallel):
    """A real pretrained model (smollm2-135m: Llama layout, tied embeddings) in bf16 on one GPU (TP=1)
    against HF in fp32: the bf16 mismatch the learner brings to the logprob_mismatch column."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir_or_skip("smollm2-135m"), dtype=torch.float32).cuda().eval()
    policy = make_policy(hf, distributed_optimizer=True, dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (4, 65), device="cuda", generator=g)
    got, ref = policy.logprobs(ids).float(), hf_logprobs(hf, ids)
    diff = (got - ref).abs()
    print(f"smollm2-135m megatron bf16 vs HF fp32: mean {diff.mean():.2e} max {diff.max():.2e}")
    # bf16 weights and activations on random tokens (high entropy): torch's bf16 autocast alone gives a
    # mean of ~0.04 here on CPU; bf16 weights add to it. A wrong conversion is O(1).
    assert torch.isfinite(got).all() and diff.mean() < 0.15


def _score_with_backend(rank: int, port: int, model_dir: str, out: str, kernel: str) -> None:
    """MegatronBackend (bf16, one GPU; `kernel` te: Transformer Engine's attention, packed as THD;
    varlen: the local spec with torch's varlen flash attention, packed as one row): scores of one
    packed and one padded micro-batch of the same sequences, written to `out`."""
    from async_rl.learner.batch import packing
    from async_rl.learner.megatron.backend import MegatronBackend
    from tests.unit._megatron_ranks import seq_samples

    backend = MegatronBackend(
        rank=rank, world_size=1, master=f"127.0.0.1:{port}", tensor_parallel_size=1, pipeline_parallel_size=1,
        dtype="bfloat16", lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, distributed_optimizer=True,
        transformer_engine="on" if kernel == "te" else "off", device="cuda", seed=0, attention="auto",
    )
    try:
        backend.setup(model_dir)
        assert backend.packed_as == ("thd" if kernel == "te" else "row")  # auto: varlen on CUDA in bf16
        samples = seq_samples(min(backend.arch.vocab_size, 1000))
        mbs = {"packed": packing.packed(samples, row_tokens=16), "padded": packing.padded(samples)}
        logp = {k: mb.per_sequence(backend.score(mb, 1.0).logp) for k, mb in mbs.items()}
        torch.save(logp, out)
    finally:
        backend.shutdown()


@pytest.mark.parametrize("kernel", ["te", "varlen"])
def test_packed_sequences_do_not_attend_across_boundaries(tmp_path, kernel):
    """Packed rows (several sequences each, given to TE as THD or to varlen flash attention as one row
    with cu_seqlens) score as the same sequences padded one per row: with the block-diagonal mask TE
    ignored, every sequence after the first of a row read its predecessors and its log-probs moved by
    O(1); a wrong RoPE offset or bound in the varlen row would move them too."""
    import torch.multiprocessing as mp

    from async_rl.models.tiny import resolve_model_path

    if kernel == "te" and not mm.transformer_engine_available():
        pytest.skip("transformer_engine is not importable")
    model_dir = resolve_model_path("tiny-qwen2", str(tmp_path / "models"))
    out = tmp_path / "logp.pt"
    mp.spawn(_score_with_backend, args=(free_port(), str(model_dir), str(out), kernel), nprocs=1, join=True)
    logp = torch.load(out, weights_only=False)
    for packed, padded in zip(logp["packed"], logp["padded"], strict=True):
        assert abs(packed - padded).max() < 5e-2, abs(packed - padded).max()  # bf16


@pytest.mark.parametrize("te_spec", [False, True], ids=["local", "te"])
@pytest.mark.parametrize("name", sorted(MODELS))  # qwen2 has qkv biases, llama none
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_distributed_optimizer_checkpoint_resumes_the_same_step(model_parallel, dtype, name, te_spec):
    """One step after saving and loading the distributed optimizer (its state_dict and this rank's
    parameter state, as MegatronBackend.save/load) equals the step without them; on GPU megatron
    uses TE's or Apex's fused Adam when one is installed, and bf16 keeps separate fp32 main weights.
    bf16 with qwen2's biases and the local spec crashed in the load before every parameter was built
    in the model's dtype (Megatron-LM #2777; tests/unit/test_megatron_checkpoint.py has it on CPU)."""
    from async_rl.learner.megatron.backend import load_parameter_state, parameter_state

    if te_spec and not mm.transformer_engine_available():
        pytest.skip("transformer_engine is not importable")
    hf = MODELS[name]().cuda()
    policy = make_policy(hf, distributed_optimizer=True, dtype=dtype, te_spec=te_spec)
    b = fixed_batch(hf.config.vocab_size)
    b.behav_logp = policy.logprobs(b.input_ids).float().cpu() * b.loss_mask
    policy.train_batch(b, 1, 1.0, 0.2, 0.2, 2.0)
    weights = {n: t.clone() for n, t in policy.hf_state_dict().items()}
    state, params = policy.optimizer.state_dict(), parameter_state(policy.optimizer)
    policy.train_batch(b, 1, 1.0, 0.2, 0.2, 2.0)
    want = policy.hf_state_dict()
    hf.load_state_dict(weights, strict=False)
    resumed = make_policy(hf, distributed_optimizer=True, dtype=dtype, te_spec=te_spec)
    resumed.optimizer.load_state_dict(state)
    load_parameter_state(resumed.optimizer, params)
    resumed.train_batch(b, 1, 1.0, 0.2, 0.2, 2.0)
    got = resumed.hf_state_dict()
    for n, t in want.items():
        assert torch.equal(got[n], t), (n, (got[n].float() - t.float()).abs().max())


@pytest.mark.parametrize("te_spec", [False, True])
def test_moe_logprobs_and_replay_match_hf_on_gpu(model_parallel, te_spec):
    """Qwen3-MoE on CUDA: megatron's all-to-all token dispatcher (GPU only), SequentialMLP experts (local
    spec) or Transformer Engine's grouped experts (`TEGroupedMLP`, names `linear_fc1.weight{j}`): the
    export is HF's bit for bit, the log-probs HF's, and replayed forced routes run exactly and match
    HF forced onto them (fp32)."""
    from async_rl.learner.megatron import routing
    from tests.unit._megatron_models import hf_routes, tiny_qwen3_moe
    from tests.unit._megatron_moe_ranks import forced_routes

    if te_spec and not mm.transformer_engine_available():
        pytest.skip("transformer_engine is not importable")
    hf = tiny_qwen3_moe().cuda().eval()
    policy = make_policy(hf, distributed_optimizer=False, te_spec=te_spec)
    assert policy.config.moe_token_dispatcher_type == "alltoall" and policy.config.moe_grouped_gemm == te_spec
    exported = policy.hf_state_dict()
    for n, t in hf.named_parameters():
        assert torch.equal(exported[n], t), n
    replay = routing.RoutingReplay.install(policy.model, 0)
    arch = policy.arch
    ids = torch.randint(0, arch.vocab_size, (2, 17), device="cuda")
    with replay.feeding(None, False):
        got = policy.logprobs(ids)
    assert torch.allclose(got, hf_logprobs(hf, ids), atol=1e-4, rtol=0)
    b, t = ids.shape
    forced = forced_routes(b * t, arch.num_layers, arch.num_experts, arch.moe_top_k).cuda()
    rows = forced.reshape(b, t, *forced.shape[1:])
    with replay.feeding(routing.token_routes(rows, b, t, one_row=False), True):
        got = policy.logprobs(ids)
    ran = replay.ran().reshape(t, b, *forced.shape[1:]).transpose(0, 1)
    assert torch.equal(ran, rows)
    with hf_routes(hf, forced=forced):
        ref = hf_logprobs(hf, ids)
    assert torch.allclose(got, ref, atol=1e-4, rtol=0)
