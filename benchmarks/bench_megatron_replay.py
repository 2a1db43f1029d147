"""Megatron's routing replay as the learner's weights move away from the engine's (CPU, fp32, one rank).

The "engine" is the HF model at version 0 (transformers' Qwen3-MoE, random, 2 layers, 8 experts, top-2:
the tests' tiny model, or `--experts/--layers` wider): it scores an evaluation batch and records its
routers' choices, as vLLM's capture would. The learner is megatron-core's copy of the same weights
(`learner/megatron/`) trained with megatron's optimizer on a fixed PPO batch; after each step it scores
the evaluation batch against the engine's version-0 log-probs and routes, with replay off (its live
router) and on (the engine's routes). Per step (= the engine's lag behind the learner):

  agreement     tokens whose live top-k set equals the engine's in every MoE layer (replay off)
  worst_layer   the lowest per-layer agreement
  mismatch_off  mean |learner log-prob - engine log-prob| over the batch, live router
  mismatch_on   the same with the engine's routes replayed
  max_off/on    the largest |learner log-prob - engine log-prob| of the batch, without and with replay

At lag 0 with an fp32 engine both mismatches are fp32 noise and the agreement is 1; as the weights
move the learner's router departs from the engine's and replay removes the part of the mismatch that
routing explains. `--engine-dtype bfloat16`: the engine's numerics differ from the learner's (as
vLLM's bf16 kernels do from a trainer's), so its routers flip near-ties already at lag 0.

    python benchmarks/bench_megatron_replay.py [--steps 6] [--lr 3e-3] [--engine-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--cols", type=int, default=48)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--engine-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the engine's dtype: bfloat16 stands in for an engine whose numerics differ from the "
                             "learner's fp32 (its routers flip near-ties)")
    args = parser.parse_args()

    from async_rl.learner.megatron import convert as mcv
    from async_rl.learner.megatron import cpu as megatron_cpu
    from async_rl.learner.megatron import routing
    from async_rl.learner.megatron.learner import MegatronPolicy, megatron_optimizer
    from async_rl.learner.moe_metrics import local_metrics
    from async_rl.learner.rl.algorithms import token_logprobs
    from tests.unit._megatron_models import fixed_batch, hf_routes, one_rank_model_parallel, tiny_qwen3_moe

    torch.set_num_threads(2)
    engine = tiny_qwen3_moe(experts=args.experts).eval()
    arch = mcv.arch_from_hf_config(engine.config)
    weights = {n: p.detach().clone() for n, p in engine.named_parameters()}  # the learner starts from fp32
    engine = engine.to(getattr(torch, args.engine_dtype))
    ids = torch.randint(0, arch.vocab_size, (args.rows, args.cols), generator=torch.Generator().manual_seed(1))
    b, t = ids.shape
    with torch.no_grad(), hf_routes(engine) as seen:
        engine_logp = token_logprobs(engine(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])
    engine_routes = seen[0].reshape(b, t, arch.num_layers, arch.moe_top_k)
    order = routing.token_routes(engine_routes, b, t, one_row=False)

    with contextlib.ExitStack() as stack:
        stack.enter_context(one_rank_model_parallel())
        stack.enter_context(megatron_cpu.patched())
        policy = MegatronPolicy(
            arch, weights, dtype=torch.float32, lr=args.lr, weight_decay=0.0,
            max_grad_norm=1.0, distributed_optimizer=False, te_spec=False, cpu_init=True,
            make_optimizer=lambda ddp: megatron_optimizer(ddp, torch.float32, args.lr, 0.0, 1.0, False),
        )
        replay = routing.RoutingReplay.install(policy.model, 0)
        train = fixed_batch(arch.vocab_size)
        print(f"{'lag':>3} {'agreement':>9} {'worst_layer':>11} {'mismatch_off':>12} {'mismatch_on':>11} "
              f"{'max_off':>8} {'max_on':>8}")
        for lag in range(args.steps + 1):
            replay.reset()
            with replay.feeding(order, False):
                live = policy.logprobs(ids)
            m = local_metrics(replay.stats(), False)
            with replay.feeding(order, True):
                replayed = policy.logprobs(ids)
            replay.clear()
            off, on = (live - engine_logp).abs(), (replayed - engine_logp).abs()
            print(f"{lag:>3} {m.router_agreement:>9.3f} {m.router_agreement_worst_layer:>11.3f} "
                  f"{float(off.mean()):>12.2e} {float(on.mean()):>11.2e} {float(off.max()):>8.2e} "
                  f"{float(on.max()):>8.2e}", flush=True)
            train.behav_logp = policy.logprobs(train.input_ids).detach() * train.loss_mask
            policy.train_batch(train, 2, 1.0, 0.2, 0.2, 2.0)


if __name__ == "__main__":
    main()
