"""An MoE sample's recorded routes laid out with its tokens in a micro-batch (rollout routing replay).

A sample's routes (`protocol.TrajectoryGroup.routes`) are [tokens - 1, moe_layers, top_k], unsigned: row
j is what the engine's routers chose for token j; the last token never ran forward in the engine. In a
micro-batch they become int32 [B, T, moe_layers, top_k] aligned with `input_ids`: the expert ids where a
route was recorded, `ROUTE_LIVE` where the learner's live router decides (a row all `route_missing`, a
sample's last token, a sample without routes), `ROUTE_PAD` on padding (no token: left out of the
router statistics). The layouts (`packing.packed`, `packing.padded`, `shared_prefix.shared`) put a
token's row wherever they put the token; `learner/model/moe.py` replays them.
"""

from __future__ import annotations

import numpy as np
import torch

from async_rl.protocol import ROUTE_DTYPES, route_missing

ROUTE_LIVE = -1
ROUTE_PAD = -2


def route_table(rows: int, width: int, shape: tuple[int, int]) -> torch.Tensor:
    """An empty micro-batch route tensor [rows, width, layers, top_k]: all padding."""
    return torch.full((rows, width, *shape), ROUTE_PAD, dtype=torch.int32)


def as_live_marked(routes: np.ndarray) -> torch.Tensor:
    """int32 copy of a sample's routes with every row that holds `route_missing` set to `ROUTE_LIVE`."""
    out = torch.from_numpy(routes.astype(np.int32))
    missing = torch.from_numpy((routes == route_missing(routes.dtype)).reshape(len(routes), -1).any(axis=1))
    out[missing] = ROUTE_LIVE
    return out


def put_routes(dst: torch.Tensor, at: int, tokens: int, routes: np.ndarray | None) -> None:
    """Tokens at..at+tokens of one row of a route tensor (`dst` [width, layers, top_k]) from `routes`'s
    first rows (as many as it has, at most `tokens`; the rest live)."""
    dst[at : at + tokens] = ROUTE_LIVE
    if routes is not None and len(routes):
        n = min(len(routes), tokens)
        dst[at : at + n] = as_live_marked(routes[:n])


def unrouted_rows(routes: np.ndarray | None, tokens: int) -> int:
    """Tokens of a sample (all but its last) that have no recorded route: rows holding `route_missing`,
    or every one when the sample carries no routes."""
    if routes is None:
        return tokens - 1
    return int((routes == route_missing(routes.dtype)).reshape(len(routes), -1).any(axis=1).sum())


def check_routes(routes: np.ndarray, tokens: int, layers: int, top_k: int, experts: int, where: str) -> None:
    """A sample's routes against its tokens and the model: ValueError in one line naming what is wrong."""
    want = (tokens - 1, layers, top_k)
    if routes.ndim != 3 or tuple(routes.shape) != want:
        raise ValueError(
            f"{where}: routes of shape {tuple(routes.shape)}, expected [{tokens - 1} tokens, {layers} MoE layers, "
            f"top-{top_k}] for this sample and model"
        )
    if routes.dtype not in ROUTE_DTYPES:
        raise ValueError(f"{where}: routes of dtype {routes.dtype}, expected uint8 or uint16")
    missing = route_missing(routes.dtype)
    bad = (routes >= experts) & (routes != missing)
    if bad.any():
        raise ValueError(f"{where}: routes name expert {int(routes[bad].max())}, the model has {experts}")
