"""An MoE step's routing metrics: the micro-batches' router statistics summed on the device, reduced over
the learner group in one collective at the step's end, and turned into `base.MoeMetrics`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from async_rl.learner.base import MoeMetrics
from async_rl.learner.model.moe import MoeShape, RouterStats

# The probe's sums: |learner - engine| and the tokens, with replay on and with the live router.
ProbeSums = tuple[float, float, float, float]


class RouterTally:
    """The router statistics of one step's gradient passes (every update), summed as they come."""

    def __init__(self, shape: MoeShape, device: torch.device) -> None:
        self.shape = shape
        def z(*size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.float64, device=device)

        self.routed, self.agree_all, self.tokens, self.aux, self.passes = z(), z(), z(), z(), z()
        self.agree_layer = z(shape.layers)
        self.load = z(shape.layers, shape.experts)

    def add(self, stats: RouterStats) -> None:
        self.routed += stats.routed
        self.agree_all += stats.agree_all
        self.agree_layer += stats.agree_layer
        self.tokens += stats.tokens
        self.load += stats.load
        if stats.aux_loss is not None:
            self.aux += stats.aux_loss.detach().to(torch.float64)
            self.passes += 1

    def metrics(
        self, replay: bool, unrouted: int, probe: ProbeSums | None,
        all_reduce: Callable[[torch.Tensor], torch.Tensor],
    ) -> MoeMetrics:
        """The step's metrics over the whole group (one sum collective: every rank gets the same)."""
        layers = self.shape.layers
        extra = torch.tensor([float(unrouted), *(probe or (0.0, 0.0, 0.0, 0.0))], dtype=torch.float64,
                             device=self.routed.device)
        head = torch.stack([self.routed, self.agree_all, self.tokens, self.aux, self.passes])
        total = all_reduce(torch.cat([head, extra, self.agree_layer, self.load.flatten()])).cpu()
        routed, agree_all, tokens, aux, passes = total[:5].tolist()
        unrouted_sum, on_abs, on_n, live_abs, live_n = total[5:10].tolist()
        agree_layer = total[10 : 10 + layers]
        load = total[10 + layers :].reshape(layers, self.shape.experts)
        mean = load.mean(dim=1).clamp(min=1e-12)
        worst = int(agree_layer.argmin())
        return MoeMetrics(
            replay=replay,
            routed_tokens=int(routed),
            unrouted_tokens=int(unrouted_sum),
            router_agreement=agree_all / routed if routed else None,
            router_agreement_worst_layer=float(agree_layer[worst]) / routed if routed else None,
            worst_layer=worst if routed else 0,
            expert_load_max_mean=float((load.max(dim=1).values / mean).max()) if tokens else 0.0,
            aux_loss=aux / passes if passes else 0.0,
            mismatch_replay=on_abs / on_n if probe is not None and on_n else None,
            mismatch_live=live_abs / live_n if probe is not None and live_n else None,
        )


def local_metrics(stats: RouterStats, replay: bool) -> MoeMetrics:
    """The metrics of one rank's router statistics alone (no collective, no probe): benchmarks and tests that
    run a model's forwards outside the driver."""
    layers, experts = stats.load.shape
    tally = RouterTally(MoeShape(layers=layers, experts=experts, top_k=0), stats.load.device)
    tally.add(stats)
    unrouted = int(stats.tokens - stats.routed)
    return tally.metrics(replay, unrouted, None, lambda x: x)
