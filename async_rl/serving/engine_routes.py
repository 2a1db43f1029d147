"""The engine's side of routing capture: start it in vLLM's workers, and give each finished completion
its routes in the contract's form (protocol.ROUTE_DTYPES), from vLLM's native array (CUDA) or from the
workers' recorders (CPU, serving/route_capture.py)."""

from __future__ import annotations

import msgspec
import numpy as np

from async_rl.protocol import route_dtype, route_missing, route_rows
from async_rl.serving import worker_extension as ext
from async_rl.serving.route_capture import RouteCapture
from async_rl.serving.vllm_compat import Completion, watched

# collective_rpc takes method names; derived from the class so a rename breaks loudly here.
_CAPTURE_ROUTES = ext.WeightReceiverExtension.async_rl_capture_routes.__name__
_TAKE_ROUTES = ext.WeightReceiverExtension.async_rl_take_routes.__name__


async def start(llm, routes: RouteCapture) -> None:
    """CPU: every worker hooks its MoE routers (one line when the model has none)."""
    bound = await watched(llm, llm.collective_rpc(_CAPTURE_ROUTES, args=(routes.num_experts, routes.top_k)), "capture")
    if any(b != len(routes.moe_layers) for b in bound):
        raise RuntimeError(
            f"generators.capture_routes: vLLM's model has {bound[0]} MoE routers to hook, the config says "
            f"{len(routes.moe_layers)} MoE layers"
        )


async def attach(llm, routes: RouteCapture, prompt_len: int, completions: list[Completion]) -> None:
    """Each completion's routes in the contract's form (protocol.ROUTE_DTYPES): prompt_len + its
    length - 1 rows (those never captured ROUTE_MISSING), the MoE layers' columns. CUDA: from vLLM's
    native array; CPU: taken from the workers' recorders (TP workers route alike: rank 0's)."""
    taken: dict = {}
    if any(c.routes is None for c in completions):
        raw = await watched(llm, llm.collective_rpc(_TAKE_ROUTES, args=(sorted({c.request_id for c in completions}),)), "routes")
        taken = msgspec.msgpack.decode(raw[0])
    dtype = route_dtype(routes.num_experts)
    for c in completions:
        rows = route_rows(prompt_len, len(c.token_ids))
        out = np.full((rows, len(routes.moe_layers), routes.top_k), route_missing(dtype), dtype)
        if c.routes is not None:  # native: a column per layer, MoE or not
            got = np.asarray(c.routes)[:, routes.moe_layers].astype(dtype)
        else:
            shape, data = taken.get(c.request_id, {}).get(c.index, ([0, *out.shape[1:]], b""))
            got = np.frombuffer(data, dtype=dtype).reshape(shape)
        n = min(rows, len(got))
        out[:n] = got[:n]
        c.routes = out


def sequence_routes(tokens: list[int], turns: list[tuple[list[int], np.ndarray]]) -> np.ndarray | None:
    """A multi-turn sequence's routes (an environment episode, an agent's segment: prompt, model turns,
    environment turns) from its model turns' (input ids, routes): each row from the first turn that ran that position forward (the one whose
    KV the next tokens of that turn attended to; with prefix caching off a later turn computes the
    prefix again, on weights that may have moved since). A turn whose input is not a prefix of the
    episode's tokens (it cannot be in token in / token out) gives no row: its rows stay ROUTE_MISSING,
    which the learner's live router takes and counts. None when no turn recorded routes."""
    if not turns:
        return None
    first = turns[0][1]
    out = np.full((route_rows(len(tokens), 0), *first.shape[1:]), route_missing(first.dtype), first.dtype)
    missing = np.ones(len(out), bool)
    for ids, rows in turns:
        if tokens[: len(ids)] != list(ids):
            continue
        n = min(len(rows), len(out))
        fill = missing[:n] & ~(rows[:n] == route_missing(rows.dtype)).all(axis=(1, 2))
        out[:n][fill] = rows[:n][fill]
        missing[:n] &= ~fill
    return out
