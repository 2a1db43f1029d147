"""Mixtures of experts in megatron-core on CPU (gloo, one rank, TP=PP=EP=1): Qwen3-MoE and Qwen2-MoE
(a shared expert with a sigmoid gate, no top-k renormalisation) built as megatron's MoE layers, the
HF -> Megatron -> HF round trip exact, log-probs equal to HF's (fp32), and rollout routing replay
(`megatron.routing`): the experts megatron runs are the recorded ones for every routed token, a token
without a route takes the live router (counted), and the log-probs equal HF's run on the same routes.
The routes are the HF model's own router choices (what the engine records), or forced ones that the
live router would not pick. TP=2 and EP=2: test_megatron_moe_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.errors import ConfigError  # noqa: E402
from async_rl.learner.megatron import convert as mcv  # noqa: E402
from async_rl.learner.megatron import cpu as megatron_cpu  # noqa: E402
from async_rl.learner.megatron import model as mm  # noqa: E402
from async_rl.learner.megatron import routing  # noqa: E402
from async_rl.learner.moe_metrics import local_metrics  # noqa: E402
from async_rl.learner.rl.algorithms import token_logprobs  # noqa: E402
from tests.unit._megatron_models import (  # noqa: E402
    hf_routes,
    megatron_copy,
    one_rank_model_parallel,
    tiny_qwen2_moe,
    tiny_qwen3_moe,
)
from tests.unit._megatron_moe_ranks import forced_routes  # noqa: E402

MODELS = {"qwen3_moe": tiny_qwen3_moe, "qwen2_moe": tiny_qwen2_moe}


@pytest.fixture(scope="module")
def model_parallel():
    with one_rank_model_parallel():
        yield


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, model_parallel):
    """(HF model, arch, Megatron GPTModel with the HF weights, its RoutingReplay)."""
    hf = MODELS[request.param]().eval()
    arch, model = megatron_copy(hf)
    return hf, arch, model.eval(), routing.RoutingReplay.install(model, 0)


def _ids(vocab: int, rows: int = 3, cols: int = 17) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, cols), generator=torch.Generator().manual_seed(3))


def _megatron_logprobs(model, arch, ids: torch.Tensor, replay: routing.RoutingReplay,
                       routes: torch.Tensor | None, on: bool) -> torch.Tensor:
    """Log-probs of `ids`; `routes` long [B, T, layers, k] aligned with `ids` (negative: no route)."""
    b, t = ids.shape
    order = None if routes is None else routing.token_routes(routes, b, t, one_row=False)
    with torch.no_grad(), megatron_cpu.patched(), replay.feeding(order, on):
        logits = mm.forward_logits(model, ids)
    return mm.vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], arch.vocab_size)


def _as_rows(tokens: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """HF's router order (row-major [B, T]) -> [B, T, layers, k]."""
    return tokens.reshape(b, t, *tokens.shape[1:])


def _megatron_order_to_rows(ran: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """Megatron's router order of a [B, T] forward ([T, B] flattened) -> [B, T, layers, k]."""
    return ran.reshape(t, b, *ran.shape[1:]).transpose(0, 1)


def _sorted(x: torch.Tensor) -> torch.Tensor:
    return x.sort(dim=-1).values


def _forced(arch, tokens: int, seed: int) -> torch.Tensor:
    """Distinct random experts per token and layer: long [tokens, layers, k] (not the live choice)."""
    return forced_routes(tokens, arch.num_layers, arch.num_experts, arch.moe_top_k, seed)


def _hf_live(hf, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's log-probs of `ids` and its routers' choices (long [tokens, layers, k], row-major over [B, T])."""
    with torch.no_grad(), hf_routes(hf) as seen:
        ref = token_logprobs(hf(input_ids=ids).logits[:, :-1], ids[:, 1:])
    return ref, seen[0]


def test_arch_reads_the_moe_config(pair):
    hf, arch, _, _ = pair
    cfg = hf.config
    assert (arch.num_experts, arch.moe_top_k, arch.moe_ffn_hidden_size) == (8, 2, 32)
    assert arch.norm_topk_prob == cfg.norm_topk_prob
    assert arch.qk_norm == (cfg.model_type == "qwen3_moe")
    assert arch.shared_expert_ffn == (48 if cfg.model_type == "qwen2_moe" else 0)


def test_the_model_is_megatrons_moe_with_the_hf_parameter_count(pair):
    hf, arch, model, replay = pair
    from megatron.core.transformer.moe.moe_layer import MoELayer

    assert sum(isinstance(m, MoELayer) for m in model.modules()) == arch.num_layers == len(replay.layers)
    assert model.config.moe_router_pre_softmax == (not arch.norm_topk_prob)
    assert not model.config.moe_router_fusion
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())


def test_hf_to_megatron_to_hf_round_trip_is_exact(pair):
    hf, arch, model, _ = pair
    back = mm.hf_state_dict(model, arch, te_spec=False)
    ref = dict(hf.named_parameters())
    assert list(back) == list(ref)
    assert mm.hf_param_shapes(arch, 1, 0) == {n: tuple(t.shape) for n, t in ref.items()}
    for name, t in ref.items():
        assert torch.equal(back[name], t), name


def test_a_checkpoint_on_disk_with_per_expert_names_loads(pair, tmp_path):
    """save_pretrained writes the experts one by one (`mlp.experts.{e}.gate_proj.weight`): they load."""
    hf, arch, model, _ = pair
    hf.save_pretrained(tmp_path)
    disk = mm.SafetensorsCheckpoint(tmp_path)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in disk and "model.layers.0.mlp.experts.gate_up_proj" not in disk
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    mm.load_hf_weights(model, disk, arch, te_spec=False)
    back = mm.hf_state_dict(model, arch, te_spec=False)
    assert all(torch.equal(back[n], t) for n, t in hf.named_parameters())


def test_logprobs_match_the_hf_model_and_the_live_routes_are_hfs(pair):
    hf, arch, model, replay = pair
    ids = _ids(arch.vocab_size)
    b, t = ids.shape
    ref, seen = _hf_live(hf, ids)
    replay.reset()
    got = _megatron_logprobs(model, arch, ids, replay, None, on=False)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()
    live = _megatron_order_to_rows(replay.ran(), b, t)
    assert torch.equal(_sorted(live), _sorted(_as_rows(seen, b, t)))
    assert float(replay.stats().load.sum()) == b * t * arch.num_layers * arch.moe_top_k
    # replaying the live choices (what an engine on the same weights records) changes nothing
    replay.reset()
    got = _megatron_logprobs(model, arch, ids, replay, _as_rows(seen, b, t), on=True)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)
    assert local_metrics(replay.take(), True).router_agreement == 1.0


def test_replay_runs_the_given_routes_and_matches_hf_on_the_same_routes(pair):
    """Routes the live router would not choose (a random top-k per token and layer): megatron runs
    exactly them, and its log-probs equal HF's forced onto the same routes; the agreement it counts is
    the fraction of tokens whose routes happen to be the live choice."""
    hf, arch, model, replay = pair
    ids = _ids(arch.vocab_size)
    b, t = ids.shape
    forced = _forced(arch, b * t, 7)
    live_ref, live_seen = _hf_live(hf, ids)
    with torch.no_grad(), hf_routes(hf, forced=forced):
        ref = token_logprobs(hf(input_ids=ids).logits[:, :-1], ids[:, 1:])
    assert (ref - live_ref).abs().max() > 1e-3  # the forced routes change the model's output
    replay.reset()
    got = _megatron_logprobs(model, arch, ids, replay, _as_rows(forced, b, t), on=True)
    assert torch.equal(_megatron_order_to_rows(replay.ran(), b, t), _as_rows(forced, b, t))
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()
    # the agreement of the live router with these routes, as counted on the host
    live = _sorted(live_seen)
    agree_layer = (live == _sorted(forced)).all(dim=-1)  # [tokens, layers]
    stats = replay.stats()
    assert float(stats.routed) == float(stats.tokens) == b * t
    assert stats.agree_layer.tolist() == agree_layer.sum(dim=0).double().tolist()
    assert float(stats.agree_all) == float(agree_layer.all(dim=1).sum())
    metrics = local_metrics(stats, True)
    assert metrics.router_agreement == pytest.approx(float(agree_layer.all(dim=1).double().mean()))
    assert metrics.router_agreement_worst_layer == pytest.approx(float(agree_layer.double().mean(dim=0).min()))


def test_tokens_without_a_route_take_the_live_router_and_are_counted(pair):
    hf, arch, model, replay = pair
    ids = _ids(arch.vocab_size)
    b, t = ids.shape
    forced = _as_rows(_forced(arch, b * t, 9), b, t)
    routes = forced.clone()
    routes[:, -1] = -1  # every sample's last token: it never ran forward in the engine
    routes[0, 3:6] = -1  # rows the engine did not record
    routes[1] = -1  # a sample without routes
    routes[2, 10:] = routing.PAD  # padding: neither routed nor counted as unrouted
    replay.reset()
    _megatron_logprobs(model, arch, ids, replay, None, on=False)
    live = _megatron_order_to_rows(replay.ran(), b, t)
    replay.reset()
    _megatron_logprobs(model, arch, ids, replay, routes, on=True)
    ran = _megatron_order_to_rows(replay.ran(), b, t)
    routed = routes[..., 0, 0] >= 0
    assert torch.equal(ran[routed], forced[routed])
    assert torch.equal(_sorted(ran[1]), _sorted(live[1]))  # the sample without routes runs as the live model
    assert not torch.equal(_sorted(ran[0]), _sorted(live[0]))  # (its neighbours' replay does not reach it)
    stats = replay.stats()
    assert float(stats.tokens - stats.routed) == int((routes[..., 0, 0] == -1).sum()) == 1 + 3 + t
    assert float(stats.routed) == int(routed.sum()) == b * t - (1 + 3 + t) - (t - 10)
    assert float(stats.load.sum()) == (b * t - (t - 10)) * arch.num_layers * arch.moe_top_k  # padding left out


def test_replay_gives_the_router_a_gradient(pair):
    """The replayed probabilities are gathered from the live router's scores: the loss reaches it."""
    hf, arch, model, replay = pair
    ids = _ids(arch.vocab_size, rows=2, cols=9)
    b, t = ids.shape
    with torch.no_grad(), hf_routes(hf) as seen:
        hf(input_ids=ids)
    order = routing.token_routes(_as_rows(seen[0], b, t), b, t, one_row=False)
    model.zero_grad()
    with megatron_cpu.patched(), replay.feeding(order, True):
        logits = mm.forward_logits(model, ids)
    mm.vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], arch.vocab_size).sum().backward()
    grads = [p.grad for n, p in mm.parameters_by_name(model).items() if n.endswith("router.weight")]
    assert len(grads) == arch.num_layers and all(g is not None and g.abs().sum() > 0 for g in grads)
    model.zero_grad()


def _replayed_grads(model, arch, replay, ids: torch.Tensor, order: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    with megatron_cpu.patched():
        with replay.feeding(order, True):
            logits = mm.forward_logits(model, ids)
        # the backward runs after the block, as megatron's schedule runs it: a recompute replays the
        # targets still in place
        mm.vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], arch.vocab_size).sum().backward()
    grads = {n: p.grad.clone() for n, p in mm.parameters_by_name(model).items()}
    model.zero_grad()
    return grads


def test_activation_recompute_replays_the_same_routes(pair):
    """learner.activation_checkpointing: megatron recomputes each layer in the backward, its router
    included; the recompute runs the micro-batch's routes again (gradients equal to the pass without
    recompute) and counts nothing twice."""
    hf, arch, model, replay = pair
    ids = _ids(arch.vocab_size, rows=2, cols=9)
    b, t = ids.shape
    order = routing.token_routes(_as_rows(_forced(arch, b * t, 5), b, t), b, t, one_row=False)
    recomputed = mm.build_model(arch, torch.float32, cpu_init=True, te_spec=False, recompute=True)
    mm.load_hf_weights(recomputed, dict(hf.named_parameters()), arch, te_spec=False)
    assert recomputed.config.recompute_granularity == "full" and recomputed.training
    replay_rc = routing.RoutingReplay.install(recomputed, 0)
    want = _replayed_grads(model, arch, replay, ids, order)
    replay_rc.reset()
    got = _replayed_grads(recomputed, arch, replay_rc, ids, order)
    for name, g in want.items():
        assert torch.allclose(got[name], g, atol=1e-5, rtol=1e-4), name
    assert float(replay_rc.stats().load.sum()) == b * t * arch.num_layers * arch.moe_top_k  # one forward's
    replay_rc.clear()
    assert all(layer.target is None for layer in replay_rc.layers)


def test_the_router_weight_stays_the_cpu_parameter_it_was(pair):
    """megatron's Router.gating moves its weight to torch.cuda.current_device() before each forward;
    under the CPU patches that is the CPU: the same storage (what DDP's buffers hold) after a forward."""
    _, arch, model, replay = pair
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    where = [(r.weight.device.type, r.weight.data_ptr()) for r in routers]
    _megatron_logprobs(model, arch, _ids(arch.vocab_size), replay, None, on=False)
    assert [(r.weight.device.type, r.weight.data_ptr()) for r in routers] == where
    assert all(device == "cpu" for device, _ in where)


def test_fused_routing_is_refused_with_replay(pair):
    _, _, model, _ = pair
    from megatron.core.transformer.moe.router import TopKRouter

    router = next(m for m in model.modules() if isinstance(m, TopKRouter))
    router.config.moe_router_fusion = True
    try:
        with pytest.raises(ConfigError, match="moe_router_fusion"):
            routing.RoutingReplay.install(model, 0)
    finally:
        router.config.moe_router_fusion = False


def test_token_routes_follow_megatrons_token_order():
    routes = torch.arange(2 * 3).reshape(2, 3, 1, 1)  # value = b * 3 + t
    rows = routing.token_routes(routes, 2, 4, one_row=False)[:, 0, 0]
    assert rows.tolist() == [0, 3, 1, 4, 2, 5, routing.PAD, routing.PAD]  # [T, B] order, a padded column
    assert routing.token_routes(routes, 2, 3, one_row=True)[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]


def test_layouts_the_conversion_cannot_split_are_refused():
    from tests.unit._megatron_models import tiny_llama

    arch = mcv.arch_from_hf_config(tiny_qwen3_moe().config)
    with pytest.raises(ConfigError, match="expert_model_parallel_size=3 does not divide the model's num_experts=8"):
        mcv.check_parallel_layout(arch, 1, 1, ep=3)
    with pytest.raises(ConfigError, match="expert_model_parallel_size=2 needs a mixture-of-experts model"):
        mcv.check_parallel_layout(mcv.arch_from_hf_config(tiny_llama().config), 1, 1, ep=2)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2: the 1F1B schedule"):
        routing.check_layout(pipeline=2, recompute=True, replay=True)
    routing.check_layout(pipeline=1, recompute=True, replay=True)
    routing.check_layout(pipeline=2, recompute=True, replay=False)


def test_dense_layers_among_expert_layers_are_refused():
    from transformers import Qwen3MoeConfig

    cfg = tiny_qwen3_moe().config.to_dict() | {"mlp_only_layers": [0]}
    with pytest.raises(ConfigError, match="mlp_only_layers=\\[0\\]"):
        mcv.arch_from_hf_config(Qwen3MoeConfig(**cfg))


def _backend(arch, setting: str = "auto", aux: float = 0.0):
    """A MegatronBackend that has read `arch` (no process group: what its routing checks read)."""
    from async_rl.learner.megatron.backend import MegatronBackend

    backend = MegatronBackend(rank=0, world_size=1, master="127.0.0.1:0", tensor_parallel_size=1,
                              pipeline_parallel_size=1, dtype="float32", lr=1e-3, weight_decay=0.0, max_grad_norm=1.0,
                              distributed_optimizer=False, transformer_engine="off", device="cpu", seed=0,
                              routing_replay=setting, moe_aux_loss_coef=aux)
    backend.arch, backend.device = arch, torch.device("cpu")
    return backend


def test_replay_on_a_dense_model_and_routes_of_another_shape_are_refused_in_one_line():
    from async_rl.errors import RunError
    from async_rl.learner.batch import packing
    from tests.unit._megatron_models import tiny_llama
    from tests.unit._megatron_ranks import seq_samples

    with pytest.raises(RunError, match="routing_replay=on needs a mixture-of-experts model, not the dense llama"):
        _backend(mcv.arch_from_hf_config(tiny_llama().config), "on")._setup_routing(0)
    _backend(mcv.arch_from_hf_config(tiny_llama().config), "auto")._setup_routing(0)  # auto: off for dense
    arch = mcv.arch_from_hf_config(tiny_qwen3_moe().config)
    mb = packing.packed(seq_samples(arch.vocab_size), row_tokens=16)
    rows, cols = mb.input_ids.shape
    mb.routes = torch.zeros(rows, cols, arch.num_layers + 1, arch.moe_top_k, dtype=torch.int32)
    with pytest.raises(RunError, match=r"routes of shape .* a model of 2 MoE layers, top-2"):
        _backend(arch)._routes(mb, rows, cols, one_row=False)
    mb.routes = torch.zeros(rows, cols, arch.num_layers, arch.moe_top_k, dtype=torch.int32)
    assert _backend(arch)._routes(mb, rows, cols, one_row=False).shape == (rows * cols, arch.num_layers, arch.moe_top_k)


def test_a_load_balancing_loss_is_refused_in_one_line_on_an_moe_model_only():
    from async_rl.errors import RunError
    from tests.unit._megatron_models import tiny_llama

    with pytest.raises(RunError, match="learner.moe_aux_loss_coef=0.01 is not supported by learner.backend=megatron"):
        _backend(mcv.arch_from_hf_config(tiny_qwen3_moe().config), aux=0.01)._setup_routing(0)
    dense = _backend(mcv.arch_from_hf_config(tiny_llama().config), aux=0.01)
    dense._setup_routing(0)  # a dense model has no router to balance: the coefficient changes nothing
    assert dense.moe is None and not dense.replays_routes


def test_the_launcher_refuses_a_load_balancing_loss_with_megatron_before_anything_starts():
    from async_rl.config import LearnerConfig
    from async_rl.learner.moe_settings import settings_error

    megatron = LearnerConfig(backend="megatron", moe_aux_loss_coef=0.01)
    assert "learner.moe_aux_loss_coef=0.01 is not supported by learner.backend=megatron" in settings_error(megatron, 8)
    assert settings_error(megatron, 0) is None  # dense: nothing to balance
    assert settings_error(LearnerConfig(backend="torch", moe_aux_loss_coef=0.01), 8) is None
