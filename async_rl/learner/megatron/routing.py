"""Rollout routing replay for megatron's MoE layers, and what the routers did (agreement, expert load).

megatron-core 0.16.1 routes through `moe_utils.topk_routing_with_score_function`, which hands the
top-k choice to the router's `router_replay` object (`transformer/moe/router_replay.py`, built when
`moe_enable_routing_replay` is set): `get_replay_topk(scores, topk, num_groups, group_topk,
default_compute_topk)` returns the (values, expert indices) the layer then runs. Megatron's own
`RouterReplay` replays one target for every token of a layer, keeps its instances in a process-wide
list (every model a process builds adds to it) and takes a replay-backward queue for recompute.
`LayerReplay` takes its place on each router (`RoutingReplay.install`) with what RL needs:

- per token: a token with a recorded route runs those experts; a token without one (negative ids in
  the micro-batch's route tensor: the engine recorded none, or padding) takes the live router's
  top-k. The replayed probabilities are gathered from the live scores (the softmax, or with
  Qwen3-MoE's renormalisation the top-k logits that megatron then softmaxes), so the router still
  gets a gradient;
- the live top-k is computed either way, so the same forward counts how many routed tokens the live
  router agrees with the route on (all k experts as a set) and the expert load of what ran.

The fused top-k (`moe_router_fusion`) returns before the replay hook: `install` refuses a model
built with it. Megatron's hidden states are [sequence, batch, hidden]: the router's token n of a
[B, T] micro-batch is (t = n // B, b = n % B), of the one-row layouts (THD, varlen) row-major over
[B, T]; `token_routes` lays the routes out the same way. Activation recompute re-runs a layer's
router in the backward: with one pipeline stage the micro-batch's backward follows its forward, so
the targets in place are still its own; the counting is off by then (`feeding` counts the forward
only). With several stages megatron's 1F1B schedule runs later forwards before the recompute:
`check_layout` refuses replay with recompute there.

Each pipeline stage routes the same tokens through its own layers, so whether a token agreed in every
layer is known only across stages: with several stages each forward keeps its per-token flags
(agreed in every layer of this stage), and `joined_stats` takes their minimum over the stages once the
schedule has run (one collective of the flags, one of the per-layer counts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from async_rl.errors import ConfigError
from async_rl.learner.batch.routes import ROUTE_PAD as PAD  # padding: left out of the counts; -1: live
from async_rl.learner.model.moe import RouterStats

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class LayerReplay:
    """One router's replay target and counts; megatron calls `get_replay_topk` as it would call its
    own `RouterReplay`'s (same signature)."""

    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.target: torch.Tensor | None = None  # long [tokens, k]; a row < 0: the live router's
        self.replay = False
        self.counting = False
        self.ran: torch.Tensor | None = None  # long [tokens, k]: the experts of the last forward
        self.agree: torch.Tensor | None = None  # bool [tokens]: live top-k == route (rows with a route)
        self.load = torch.zeros(experts, dtype=torch.float64)
        self.agree_count = torch.zeros((), dtype=torch.float64)

    def get_replay_topk(
        self, scores: torch.Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None  # megatron always passes its top-k
        values, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target
        if target is None:
            self._count(live, None, None)
            return values, live
        if target.shape != live.shape:
            raise ValueError(f"routing replay: {tuple(target.shape)} routes for a router of {tuple(live.shape)} tokens")
        target = target.to(live.device)
        has_route = target[:, 0] >= 0
        same = (live.sort(dim=1).values == target.sort(dim=1).values).all(dim=1) & has_route
        if self.replay:
            chosen = torch.where(has_route[:, None], target, live)
            values = scores.gather(1, chosen)
        else:
            chosen = live
        self._count(chosen, same, target[:, 0] != PAD)
        return values, chosen

    def _count(self, chosen: torch.Tensor, same: torch.Tensor | None, real: torch.Tensor | None) -> None:
        """Device ops only (no bincount, no boolean indexing: both read sizes on the host)."""
        if not self.counting:
            return
        self.ran, self.agree = chosen.detach(), same
        if self.load.device != chosen.device:
            self.load, self.agree_count = self.load.to(chosen.device), self.agree_count.to(chosen.device)
        weight = torch.ones(chosen.shape, dtype=torch.float64, device=chosen.device)
        if real is not None:  # padding runs the live router but is no token: left out of the load
            weight = weight * real[:, None]
        self.load.index_add_(0, chosen.detach().reshape(-1), weight.reshape(-1))
        if same is not None:
            self.agree_count += same.sum()


class RoutingReplay:
    """The `LayerReplay`s of one rank's GPTModel (its pipeline stage's MoE layers, in order)."""

    def __init__(self, layers: list[LayerReplay], first_layer: int, stages: int = 1) -> None:
        self.layers = layers
        self.first_layer = first_layer  # the model's index of this stage's first MoE layer
        self.stages = stages  # pipeline stages: above 1, each counted forward keeps its token flags
        self._unrouted = torch.zeros((), dtype=torch.float64)
        self._routed = torch.zeros((), dtype=torch.float64)
        self._agree_all: torch.Tensor | None = None
        # per counted forward (several stages only): int32 [tokens], 1 where the token has a route and
        # the live router agreed with it in every layer of this stage
        self._token_flags: list[torch.Tensor] = []

    @classmethod
    def install(cls, gpt: torch.nn.Module, first_layer: int, stages: int = 1) -> RoutingReplay:
        """A `LayerReplay` in place of megatron's replay on every TopKRouter of `gpt` (once); `stages`:
        the pipeline's, `first_layer` the model's index of this stage's first MoE layer."""
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError("routing replay: the model has no MoE router")
        if routers[0].config.moe_router_fusion:
            raise ConfigError(
                "routing replay: megatron's fused top-k (moe_router_fusion) returns before the replay hook and "
                "would skip replay silently; build the model with moe_router_fusion=False"
            )
        if not routers[0].config.moe_enable_routing_replay:
            raise ConfigError("routing replay: the model was built without moe_enable_routing_replay")
        layers = []
        for router in routers:
            if not isinstance(router.router_replay, LayerReplay):
                router.router_replay = LayerReplay(router.config.num_moe_experts)
            layers.append(router.router_replay)
        return cls(layers, first_layer, stages)

    @contextlib.contextmanager
    def feeding(self, routes: torch.Tensor | None, replay: bool, count: bool = True) -> Iterator[None]:
        """Forwards inside run with `routes` (long [tokens, model MoE layers, k] in the router's token
        order, `token_routes`; None: the live router everywhere, nothing measured against a route) and
        count unless `count` is false (a rank's dummy micro-batch); with `replay` the routed tokens run
        their recorded experts. The targets stay after the block for the recompute of this micro-batch's
        backward; the counting does not."""
        for i, layer in enumerate(self.layers):
            layer.target = None if routes is None else routes[:, self.first_layer + i]
            layer.replay = replay and routes is not None
            layer.counting = count
        try:
            yield
        finally:
            for layer in self.layers:
                layer.counting = False
            if count and routes is not None:
                self._count_tokens(routes[:, self.first_layer])
            elif count and (ran := self.layers[0].ran) is not None:  # no routes: every token (padding too) took the live router
                self._unrouted = self._unrouted + ran.shape[0]
                if self.stages > 1:
                    self._token_flags.append(torch.zeros(ran.shape[0], dtype=torch.int32, device=ran.device))

    def clear(self) -> None:
        """No replay target left in place: later forwards route live (the end of a schedule's run)."""
        for layer in self.layers:
            layer.target, layer.replay = None, False

    def _count_tokens(self, first: torch.Tensor) -> None:
        """Routed and unrouted tokens of the forward (from the first layer's rows), and the tokens
        that agreed in every layer."""
        rows = first[:, 0]
        self._routed = self._routed.to(rows.device) + (rows >= 0).sum()
        self._unrouted = self._unrouted.to(rows.device) + ((rows < 0) & (rows != PAD)).sum()
        agree = [layer.agree for layer in self.layers if layer.agree is not None]
        if len(agree) == len(self.layers):
            flags = torch.stack(agree).all(dim=0)
            every = flags.sum().to(torch.float64)
            self._agree_all = every if self._agree_all is None else self._agree_all + every
            if self.stages > 1:
                self._token_flags.append(flags.to(torch.int32))

    def ran(self) -> torch.Tensor:
        """The experts every layer ran for the last counted forward: long [tokens, layers, k]."""
        if any(layer.ran is None for layer in self.layers):
            raise RuntimeError("routing replay: no forward counted yet")
        return torch.stack([layer.ran for layer in self.layers], dim=1)

    def stats(self) -> RouterStats:
        """The routing statistics of the forwards since the last `reset` (this rank's tokens, this stage's
        MoE layers; device tensors), as the torch backend's routers report theirs (`RouterTally` sums them)."""
        dev = self.layers[0].load.device
        routed, unrouted = self._routed.to(dev), self._unrouted.to(dev)
        return RouterStats(
            routed=routed,
            agree_all=torch.zeros((), dtype=torch.float64, device=dev) if self._agree_all is None
            else self._agree_all.to(dev),
            agree_layer=torch.stack([layer.agree_count.to(dev) for layer in self.layers]),
            tokens=routed + unrouted,
            load=torch.stack([layer.load.to(dev) for layer in self.layers]),
            aux_loss=None,  # learner.moe_aux_loss_coef > 0 is refused with megatron
        )

    def joined_stats(self, model_layers: int, group: dist.ProcessGroup) -> RouterStats:
        """Collective over the pipeline group `group`: the statistics of the forwards since the last
        `reset` for the whole model, the same on every stage. A token agreed in every layer where it
        agreed in every stage's layers (the minimum of the stages' token flags: every stage ran the same
        forwards on the same tokens); the per-layer counts and loads sit at their layers' rows (a sum,
        each stage's rows zero elsewhere); the token counts are each stage's own, the same on all."""
        mine = self.stats()
        dev = mine.load.device
        rows = slice(self.first_layer, self.first_layer + len(self.layers))
        per_layer = torch.zeros(model_layers, 1 + mine.load.shape[1], dtype=torch.float64, device=dev)
        per_layer[rows, 0] = mine.agree_layer
        per_layer[rows, 1:] = mine.load
        dist.all_reduce(per_layer, group=group)
        flags = torch.cat(self._token_flags) if self._token_flags else torch.zeros(0, dtype=torch.int32, device=dev)
        if flags.numel():  # every stage ran the same forwards: all skip together (only dummy micro-batches)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        return RouterStats(
            routed=mine.routed, agree_all=flags.sum().to(torch.float64), agree_layer=per_layer[:, 0],
            tokens=mine.tokens, load=per_layer[:, 1:], aux_loss=None,
        )

    def take(self) -> RouterStats:
        """`stats`, then `reset`: the statistics of one forward when reset before it."""
        stats = self.stats()
        self.reset()
        return stats

    def reset(self) -> None:
        for layer in self.layers:
            layer.load = torch.zeros_like(layer.load)
            layer.agree_count = torch.zeros_like(layer.agree_count)
            layer.ran = layer.agree = None
        self._routed = torch.zeros_like(self._routed)
        self._unrouted = torch.zeros_like(self._unrouted)
        self._agree_all = None
        self._token_flags = []


def token_routes(routes: torch.Tensor, rows: int, cols: int, one_row: bool) -> torch.Tensor:
    """A micro-batch's routes (int [B, T, layers, k] aligned with its input ids; negative = no route,
    `PAD` = padding) in the order megatron's routers see its tokens, grown with padding to the
    [rows, cols] the forward runs (pipeline stages pad micro-batches to one shape): long
    [rows * cols, layers, k]. `one_row`: the micro-batch runs flattened to one row (THD, varlen)."""
    b, t = routes.shape[:2]
    grown = torch.full((rows, cols, *routes.shape[2:]), PAD, dtype=torch.long, device=routes.device)
    grown[:b, :t] = routes
    if not one_row:  # [S, B] order: token n is (t = n // B, b = n % B)
        grown = grown.transpose(0, 1)
    return grown.reshape(rows * cols, *routes.shape[2:])


def check_layout(pipeline: int, recompute: bool, replay: bool) -> None:
    """Refuse, in one line, replay where a layer's recompute would not see its micro-batch's routes."""
    if replay and recompute and pipeline > 1:
        raise ConfigError(
            "learner.routing_replay with learner.activation_checkpointing and learner.megatron.pipeline_parallel_size="
            f"{pipeline}: the 1F1B schedule recomputes a layer after later micro-batches' forwards, which would "
            "replay their routes; turn one of them off"
        )
