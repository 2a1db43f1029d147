"""A call into vLLM's engine core that is in flight when the core dies fails at once, not never."""

from __future__ import annotations

import asyncio
import time

import pytest

from async_rl.serving import vllm_compat as vc


class CoreClient:
    """What vc.is_dead reads of an AsyncLLM: `errored`, set by vLLM's monitor when the core exits."""

    errored = False


def test_watched_call_fails_within_a_poll_of_the_core_dying():
    llm = CoreClient()

    async def scenario():
        never = asyncio.get_running_loop().create_future()  # vLLM 0.32 never answers such a call
        asyncio.get_running_loop().call_later(0.3, lambda: setattr(llm, "errored", True))
        t0 = time.monotonic()
        with pytest.raises(vc.EngineDied, match="receive_weights v3: vLLM's engine core died"):
            await vc.watched(llm, never, "receive_weights v3")
        assert never.cancelled()
        return time.monotonic() - t0

    assert asyncio.run(scenario()) < 0.3 + 2 * vc.DEATH_POLL_S


def test_watched_call_returns_its_answer_while_the_core_lives():
    async def scenario():
        return await vc.watched(CoreClient(), asyncio.sleep(0.3, result="done"), "pause")

    assert asyncio.run(scenario()) == "done"
