"""One gloo rank of a Megatron MoE model on CPU with tensor and/or expert parallelism (spawned by
test_megatron_moe_parallel.py).

Each rank builds the same tiny Qwen3-MoE (or Qwen2-MoE), loads its shard (its TP shard of the attention, its experts
of the expert-parallel group, each split over the expert tensor-parallel ranks) into a MegatronPolicy
with megatron's own optimizer, and writes to `out_dir/rank{R}.pt`: the log-probs of a fixed batch
with the live router and with forced routes replayed, the experts each replayed forward ran, the
full weights under HF names before and after one training step (rank 0), and the log-probs after it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist


def forced_routes(tokens: int, layers: int, experts: int, top_k: int, seed: int = 7) -> torch.Tensor:
    """Distinct random experts per token and layer: long [tokens, layers, top_k] (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    picks = [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens * layers)]
    return torch.stack(picks).reshape(tokens, layers, top_k)


def logp_sum_grads(policy, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The gradient of sum(log p * mask) over `ids` through megatron's schedule, DDP reduction included,
    under HF names on rank 0 (None elsewhere): each parameter's reduced `main_grad` gathered as its
    weights are."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from async_rl.learner.megatron import model as mm

    dev = policy.device

    def forward_step(data_iterator, model):
        x = next(data_iterator)
        output = mm.forward_logits(model, x)

        def loss(logits: torch.Tensor):
            logp = mm.vocab_parallel_logprobs(logits[:, :-1], x[:, 1:], policy.arch.vocab_size)
            return (logp * mask.to(dev)).sum(), {}

        return output, loss

    policy.model.zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([ids.to(dev)]), model=[policy.model],
                                num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                forward_only=False)
    params = list(policy.model.parameters())
    weights = [p.data for p in params]
    for p in params:
        p.data = p.main_grad
    try:  # copies: a gathered tensor of one rank may be a view of the gradient buffer zeroed below
        grads = {n: g.detach().clone() for n, g in (policy.hf_state_dict() or {}).items()}
    finally:
        for p, w in zip(params, weights, strict=True):
            p.data = w
    policy.model.zero_grad_buffer()
    return grads or None


def run_moe_rank(rank: int, world: int, port: int, kind: str, tp: int, ep: int, pp: int, out_dir: str) -> None:
    from megatron.core import parallel_state

    from async_rl.learner.megatron import convert as mcv
    from async_rl.learner.megatron import cpu as megatron_cpu
    from async_rl.learner.megatron import routing
    from async_rl.learner.megatron.learner import MegatronPolicy, megatron_optimizer
    from async_rl.learner.moe_metrics import local_metrics
    from tests.unit._megatron_models import fixed_batch, tiny_moe

    torch.set_num_threads(1)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # the experts split over EP ranks whole (expert tensor parallelism 1) unless EP is 1: then over TP
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if ep == 1 else 1,
    )
    megatron_cpu.enable()
    try:
        hf = tiny_moe(kind).eval()
        arch = mcv.arch_from_hf_config(hf.config)
        lr = 1e-3
        policy = MegatronPolicy(
            arch, dict(hf.named_parameters()), dtype=torch.float32, lr=lr, weight_decay=0.0, max_grad_norm=1.0,
            distributed_optimizer=False, te_spec=False, cpu_init=True,
            make_optimizer=lambda ddp: megatron_optimizer(ddp, torch.float32, lr, 0.0, 1.0, False),
        )
        stage = parallel_state.get_pipeline_model_parallel_rank()
        first = mcv.stage_layers(arch.num_layers, pp, stage)[0]
        replay = routing.RoutingReplay.install(policy.model, first)
        b = fixed_batch(arch.vocab_size)
        rows, cols = b.input_ids.shape
        forced = forced_routes(rows * cols, arch.num_layers, arch.num_experts, arch.moe_top_k)
        with replay.feeding(None, replay=False):
            live = policy.logprobs(b.input_ids)
        replay.reset()  # the replayed forward's counts alone
        with replay.feeding(routing.token_routes(forced.reshape(rows, cols, *forced.shape[1:]), rows, cols, False), True):
            replayed = policy.logprobs(b.input_ids)
        ran = replay.ran()
        counts = local_metrics(replay.stats(), True)
        mask = torch.zeros(rows, cols - 1)
        mask[:, cols // 2:] = 1.0
        with replay.feeding(routing.token_routes(forced.reshape(rows, cols, *forced.shape[1:]), rows, cols, False), True):
            grads_replay = logp_sum_grads(policy, b.input_ids, mask)
        replay.clear()
        grads_live = logp_sum_grads(policy, b.input_ids, mask)
        before = {n: t.detach().clone() for n, t in (policy.hf_state_dict() or {}).items()}
        if live is not None:  # the last pipeline stage
            b.behav_logp = live.detach() * b.loss_mask  # on-policy
        _, grad_norm = policy.train_batch(b, 2, 1.0, 0.2, 0.2, 2.0)
        after = {n: t.detach().clone() for n, t in (policy.hf_state_dict() or {}).items()}
        torch.save({
            "input_ids": b.input_ids, "loss_mask": b.loss_mask, "forced": forced, "logp_live": live,
            "logp_replay": replayed, "ran": ran, "grad_mask": mask, "grads_live": grads_live,
            "grads_replay": grads_replay, "metrics": counts, "grad_norm": grad_norm,
            "hf_before": before, "hf_after": after, "logp_after": policy.logprobs(b.input_ids),
            "ep_rank": parallel_state.get_expert_model_parallel_rank(), "first_layer": first,
        }, Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_moe_backend_rank(rank: int, world: int, port: int, model_dir: str, ep: int, attention: str, out_dir: str) -> None:
    """MegatronBackend on one rank of an MoE model (EP=`ep`, learner.routing_replay auto): scores of a
    packed micro-batch with forced routes (some rows without one) replayed and not, the experts run,
    a replay of the live choices, the routing metrics, and one training step with replay."""
    from async_rl.learner.base import MoeMetrics
    from async_rl.learner.batch import packing
    from async_rl.learner.megatron.backend import MegatronBackend
    from async_rl.learner.moe_metrics import RouterTally
    from tests.unit._megatron_ranks import seq_samples

    torch.set_num_threads(1)
    backend = MegatronBackend(
        rank=rank, world_size=world, master=f"127.0.0.1:{port}", tensor_parallel_size=1, pipeline_parallel_size=1,
        dtype="float32", lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, distributed_optimizer=False,
        transformer_engine="off", device="cpu", seed=0, attention=attention, expert_parallel_size=ep,
    )
    try:
        backend.setup(model_dir)
        arch = backend.arch
        mb = packing.packed(seq_samples(arch.vocab_size), row_tokens=16)
        rows, cols = mb.input_ids.shape
        routes = forced_routes(rows * cols, arch.num_layers, arch.num_experts, arch.moe_top_k, seed=11)
        routes = routes.reshape(rows, cols, arch.num_layers, arch.moe_top_k).to(torch.int32)
        routes[0, 2:5] = -1  # tokens the engine recorded no route for
        mb.routes = routes
        replayed = backend.score(mb, 1.0)
        ran_replayed = backend.routing.ran()
        live = backend.score_routing(mb, 1.0, replay=False)
        ran_live = backend.routing.ran()
        # the live choices as routes: replaying them gives the live log-probs
        order = "row" if backend.packed_as == "row" else "mask"
        as_rows = (ran_live.reshape(1, rows, cols, *ran_live.shape[1:])[0] if order == "row"
                   else ran_live.reshape(cols, rows, *ran_live.shape[1:]).transpose(0, 1))
        own = as_rows.to(torch.int32)
        own[0, 2:5] = -1
        mb.routes = own
        replayed_live = backend.score(mb, 1.0)
        tokens = mb.loss_tokens

        def step_metrics(step: bool) -> tuple[MoeMetrics, float]:
            """A gradient pass on `mb` as the driver runs it: the router statistics of each micro-batch's
            forward into a `RouterTally`, reduced over the data-parallel ranks; one update when `step`."""
            tally = RouterTally(backend.moe, backend.device)
            unrouted = []

            def loss_fn(i, s):
                tally.add(s.router)
                unrouted.append(float(s.router.tokens - s.router.routed))
                return -(s.logp * mb.loss_mask.to(s.logp.device)).sum() / tokens

            backend.forward_backward([mb], 1.0, loss_fn)
            metrics = tally.metrics(backend.replays_routes, int(sum(unrouted)), None, backend.all_reduce)
            if not step:
                backend.drop_gradients()
                return metrics, math.nan
            return metrics, backend.optimizer_step(1e-3, 1e9)

        own_metrics, _ = step_metrics(step=False)  # the model's own routes: every routed token agrees
        mb.routes = routes
        backend.gather_weights()
        before = {n: t.clone() for n, t in backend.hf_weights().items()} if rank == 0 else None
        metrics, grad_norm = step_metrics(step=True)
        backend.gather_weights()
        after = backend.hf_weights() if rank == 0 else None
        torch.save({
            "routes": routes, "packed_as": backend.packed_as, "replayed": replayed.logp, "live": live.logp,
            "replayed_live": replayed_live.logp, "ran_replayed": ran_replayed, "metrics": metrics,
            "own_metrics": own_metrics, "moe": backend.moe, "replays_routes": backend.replays_routes,
            "loss_mask": mb.loss_mask, "grad_norm": grad_norm, "before": before, "after": after,
        }, Path(out_dir) / f"rank{rank}.pt")
    finally:
        backend.shutdown()


def run_moe_driver_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str, pp: int = 1) -> None:
    """A LearnerDriver with learner.backend=megatron on one rank of a Qwen3-MoE (learner.routing_replay auto,
    the mismatch probe on; `pp` pipeline stages, the other ranks data parallel): a step on groups carrying
    the model's own routes (one reward a group: no update), one on its own routes with other experts in
    layer 0 on some rows and in layer 1 on others (`disagree_by_layer`), then one on random routes with
    some rows missing (scored as an engine that routes as recorded would score them); writes the steps'
    `MoeMetrics` and the rows without a route.
    The stages of a replica train the same shard (that of its data-parallel rank)."""
    from transformers import AutoModelForCausalLM

    from async_rl.config import MegatronConfig
    from async_rl.learner.driver import LearnerDriver
    from tests.unit._learner_fixtures import groups, settings
    from tests.unit._moe_fixtures import disagree_by_layer, random_routes, with_routes

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    spec = settings(model_dir, backend="megatron", device="cpu", routing_probe_samples=4, world_size=world,
                    megatron=MegatronConfig(pipeline_parallel_size=pp))
    driver = LearnerDriver(spec, rank, world, f"127.0.0.1:{port}", [])
    driver.setup()
    dp_rank = rank // pp
    try:
        still = with_routes(hf, groups(4 + dp_rank, n_groups=3, group_size=3))
        for g in still:  # one reward a group: no advantage, no update, so the weights stay hf's for `mixed`
            g.rewards = [1.0] * len(g.rewards)
        own = driver.train_on_shard(0, still).moe
        mixed = driver.train_on_shard(1, disagree_by_layer(with_routes(hf, groups(6 + dp_rank, n_groups=3)), 8)).moe
        shard = random_routes(groups(8 + dp_rank, n_groups=3, group_size=3), 2, 2, 8, seed=5 + dp_rank, missing_every=4)
        missing = sum(len(range(0, len(r), 4)) for g in shard for r in g.routes)
        scores = iter(driver.compute_logprobs(shard))  # what an engine routing as recorded scores
        for g in shard:
            g.logprobs = [next(scores) for _ in g.completions]
        randomly = driver.train_on_shard(2, shard).moe
        moe = driver.backend.moe
        torch.save({"own": own, "mixed": mixed, "random": randomly, "missing": missing, "moe": (moe.layers, moe.experts, moe.top_k)},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        driver.backend.shutdown()
