"""Mixture-of-experts models in the torch learner: their routers, rollout routing replay, router statistics.

HF transformers 5.19's MoE routers (Qwen3-MoE, Qwen2-MoE with its shared expert, OLMoE) are one module
each that returns `(router_logits, router_scores, router_indices)`; the sparse block hands the scores
and indices to its experts. `RouterReplay` puts a forward hook on every router of the model, and each
forward (or forward + backward) runs inside `RouterReplay.plan(routes)`:

- *replay*: where a token has a recorded route (the engine's choice), the hook swaps the live indices
  for it and GATHERS the routing weights at those indices from the live softmax (renormalised where
  the router normalises its top-k), so the experts the engine ran are the experts the learner runs,
  and the router still gets a gradient through their probabilities. A token without a route (the row
  all `protocol.route_missing`, or a sample's last token) keeps the live router's choice.
- the hook only reads the plan; the plan's per-layer results are written per layer (not added), so an
  activation-checkpointed layer's recompute in backward replays the same indices and leaves the
  statistics as they were. The plan is set for one micro-batch and cleared on exit: nothing carries
  over to the next forward. Outside a plan the routers are untouched (HF `generate` in tests).
- statistics, on the device with no host sync (no `nonzero`, no `bincount`): the live router's
  agreement with the recorded routes (the top-k *set*, per layer and in every layer), tokens per
  expert of the chosen routing, and, when asked, the load-balancing loss of the chosen routing.

Routes arrive in the micro-batch as `MicroBatch.routes`, int32 [B, T, layers, top_k] aligned with
`input_ids` (`batch/routes.py`: `ROUTE_LIVE` where the live router decides, `ROUTE_PAD` on padding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from async_rl.learner.batch.routes import ROUTE_PAD

# Router classes whose forward returns (router_logits, router_scores, router_indices) from a softmax
# over `weight`'s logits, top-k, and an optional renormalisation (`norm_topk_prob`; Mixtral's, the
# upcycled smollm2-135m-moe preset's class, always renormalises and has no such flag): checked by
# tests/unit/test_moe_replay.py against the installed transformers.
ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter")
ALWAYS_RENORMALISED = ("MixtralTopKRouter",)


def renormalises(router: torch.nn.Module) -> bool:
    """Whether the router renormalises its top-k probabilities (what replay's gathered scores must do)."""
    return type(router).__name__ in ALWAYS_RENORMALISED or bool(router.norm_topk_prob)


@dataclass(frozen=True)
class MoeShape:
    """What routing data must match: MoE layers (in order; dense layers have none), experts, top-k."""

    layers: int
    experts: int
    top_k: int


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (module registration order is layer order in HF)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]


def moe_shape(model: torch.nn.Module) -> MoeShape | None:
    """The model's routing shape, or None for a dense model."""
    found = routers(model)
    if not found:
        return None
    return MoeShape(layers=len(found), experts=int(found[0].num_experts), top_k=int(found[0].top_k))


@dataclass
class RouterStats:
    """One forward's routing statistics, device tensors (read on the host once per step by the driver)."""

    routed: torch.Tensor  # float64 []: tokens with a recorded route
    agree_all: torch.Tensor  # float64 []: of those, tokens whose live top-k set equals the route in every layer
    agree_layer: torch.Tensor  # float64 [layers]: per layer, tokens whose live top-k set equals the route
    tokens: torch.Tensor  # float64 []: tokens routed (padding excluded)
    load: torch.Tensor  # float64 [layers, experts]: tokens per expert of the routing the experts ran
    aux_loss: torch.Tensor | None  # the load-balancing loss (with its graph), mean over layers; None if not asked


@dataclass
class RoutingPlan:
    """One forward's routing: what the hooks read, and what they write per MoE layer."""

    routes: torch.Tensor | None  # long [N, layers, top_k], N = the forward's B * T tokens
    replay: bool
    aux: bool
    # per MoE layer, written (not accumulated) by the hook: a checkpoint recompute rewrites the same
    agree: dict[int, torch.Tensor] = field(default_factory=dict)  # bool [N]
    load: dict[int, torch.Tensor] = field(default_factory=dict)  # float64 [experts]
    aux_loss: dict[int, torch.Tensor] = field(default_factory=dict)


class RouterReplay:
    """Forward hooks on a model's routers (installed once, at setup), driven per forward by `plan`."""

    def __init__(self, model: torch.nn.Module) -> None:
        found = routers(model)
        if not found:
            raise ValueError("the model has no MoE router this learner knows (" + ", ".join(ROUTER_CLASSES) + ")")
        self.shape = moe_shape(model)
        self._plan: RoutingPlan | None = None
        self._handles = [r.register_forward_hook(self._hook_for(i)) for i, r in enumerate(found)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextlib.contextmanager
    def plan(self, routes: torch.Tensor | None, replay: bool, aux: bool = False) -> Iterator[RoutingPlan]:
        """Route the forward (and the backward's recompute) of one micro-batch: `routes` int [B, T, layers,
        top_k] (`batch/routes.py`) or None (no routes: every token live, no padding known); `replay`: the
        recorded routes decide where present; `aux`: keep the load-balancing loss. Read the statistics with
        `stats` inside the block, after the forward."""
        if self._plan is not None:
            raise RuntimeError("RouterReplay.plan: a plan is already active (nested forwards)")
        flat = None
        if routes is not None:
            if tuple(routes.shape[2:]) != (self.shape.layers, self.shape.top_k):
                raise ValueError(
                    f"routes of shape {tuple(routes.shape)} do not match the model's routing "
                    f"[B, T, {self.shape.layers} MoE layers, top-{self.shape.top_k}]"
                )
            flat = routes.reshape(-1, self.shape.layers, self.shape.top_k).long()
        self._plan = RoutingPlan(routes=flat, replay=replay and flat is not None, aux=aux)
        try:
            yield self._plan
        finally:
            self._plan = None

    def stats(self, plan: RoutingPlan) -> RouterStats:
        """The statistics of `plan`'s forward (every MoE layer ran)."""
        layers = [plan.load[i] for i in range(self.shape.layers) if i in plan.load]
        if len(layers) != self.shape.layers:
            raise RuntimeError(f"RouterReplay: {len(layers)} of {self.shape.layers} MoE layers ran in this forward")
        load = torch.stack(layers)
        device = load.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        if plan.routes is None:
            routed, agree_all, agree_layer = zero, zero, torch.zeros(self.shape.layers, dtype=torch.float64, device=device)
        else:
            has = plan.routes[:, 0, 0] >= 0
            agree = torch.stack([plan.agree[i] for i in range(self.shape.layers)])  # [layers, N]
            routed = has.sum().to(torch.float64)
            agree_all = (agree.all(dim=0) & has).sum().to(torch.float64)
            agree_layer = (agree & has).sum(dim=1).to(torch.float64)
        aux = torch.stack([plan.aux_loss[i] for i in range(self.shape.layers)]).mean() if plan.aux else None
        return RouterStats(routed=routed, agree_all=agree_all, agree_layer=agree_layer,
                           tokens=load[0].sum() / self.shape.top_k, load=load, aux_loss=aux)

    def _hook_for(self, layer: int):
        def hook(module: torch.nn.Module, args, output):
            plan = self._plan
            if plan is None:
                return None  # outside a plan: the live router as it is
            return self._route(plan, layer, module, output)

        return hook

    # Eager inside a compiled decoder layer (learner.kernels=compile): one graph break per MoE layer, no
    # guard on the plan (a new object every micro-batch would recompile the layer each time).
    @torch.compiler.disable
    def _route(self, plan: RoutingPlan, layer: int, module: torch.nn.Module, output):
        logits, scores, live = output
        n, experts = logits.shape
        real = None
        chosen = live
        if plan.routes is not None:
            if plan.routes.shape[0] != n:
                raise ValueError(f"routes for {plan.routes.shape[0]} tokens, the forward routes {n}")
            recorded = plan.routes[:, layer]  # [N, top_k]
            has = recorded[:, 0] >= 0
            real = recorded[:, 0] != ROUTE_PAD
            # the top-k *set*: both sides sorted (the engine's order need not be the learner's)
            plan.agree[layer] = (recorded.sort(dim=-1).values == live.sort(dim=-1).values).all(dim=-1)
            if plan.replay:
                chosen = torch.where(has[:, None], recorded, live)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float)
                picked = probs.gather(1, chosen)
                if renormalises(module):
                    picked = picked / picked.sum(dim=-1, keepdim=True)
                scores = picked.to(scores.dtype)
        weight = torch.ones(chosen.shape, dtype=torch.float64, device=chosen.device)
        if real is not None:
            weight = weight * real[:, None]
        load = torch.zeros(experts, dtype=torch.float64, device=chosen.device)
        plan.load[layer] = load.index_add_(0, chosen.reshape(-1), weight.reshape(-1))
        if plan.aux:
            plan.aux_loss[layer] = _balance_loss(logits, plan.load[layer], real, module.top_k)
        return logits, scores, chosen


def _balance_loss(logits: torch.Tensor, load: torch.Tensor, real: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """Switch-style load balancing for one layer, as HF's `load_balancing_loss_func` per layer: experts x
    sum_e f_e P_e, f_e = assignments to e per token (the routing the experts ran, no gradient), P_e = the
    mean router probability of e (its gradient reaches the router); K when balanced."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    if real is None:
        f = load.to(probs.dtype) / probs.shape[0]
        mean_p = probs.mean(dim=0)
    else:
        w = real.to(probs.dtype)
        tokens = w.sum().clamp(min=1.0)  # a device tensor: no host read
        f = load.to(probs.dtype) / tokens
        mean_p = (probs * w[:, None]).sum(dim=0) / tokens
    return probs.shape[-1] * (f * mean_p).sum()


EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


def set_experts(model: torch.nn.Module, setting: str) -> str:
    """`learner.moe_experts` on the model (transformers' experts implementations): auto = grouped_mm (one
    sort, a histogram and two grouped GEMMs per layer: no Python loop over experts, no host sync;
    torch's grouped matmul on CUDA, and on the CPU where torch has one); returns what runs."""
    chosen = "grouped_mm" if setting == "auto" else setting
    model.set_experts_implementation(chosen)
    return chosen
