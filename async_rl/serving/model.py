"""`ServedModel`: one vLLM engine and everything its users ask of it, behind one typed interface.

The generator engine, the agents' endpoint and the LLM judge all serve through it: generate from
token ids (or a prompt text) with every token's log-prob and the policy versions a request started
and ended on; pause and resume around a weight update (a request starts only while the model runs:
a paused model holds new requests back, and keeps or aborts those in flight by its pause mode);
sleep and wake (colocated placement); receive weights (or a LoRA adapter); score tokens; report
health and processes; shut down. It owns its engine: nobody else holds the vLLM handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec

from async_rl.serving import core_start, core_watch, engine_routes
from async_rl.serving import vllm_compat as vc
from async_rl.serving.prompt_images import prompt_images
from async_rl.weight_sync.base import UpdateReceipt, WeightGroupInfo
from async_rl.weight_sync.bucketing import Manifest
from async_rl.weight_sync.checksum import ShardChecksum

T = TypeVar("T")


class Generation(msgspec.Struct):
    """One request's result: the prompt's token ids as vLLM read them, every completion, and the
    policy versions it was generated with, lowest and highest (a weight update may fall between its
    start and end; after a learner recovery the later one is the lower)."""

    prompt_ids: list[int]
    completions: list[vc.Completion]
    version_first: int
    version_last: int


class ServedModel:
    def __init__(self, spec: vc.EngineSpec, pause_mode: str = "keep", llm: Any = None) -> None:
        """`llm`: an engine already made (tests hand in a stub); None: `start` makes it from `spec`."""
        self.spec = spec
        self.pause_mode = pause_mode
        self.version = 0  # the policy version of the weights served now
        self._llm = llm
        self._running = asyncio.Event()
        self._asleep = False
        self._kv_asleep = False  # woken for a weight update (weights only): the KV cache comes back at resume
        self._paused_since: float | None = None  # held since (None: serving)
        self._paused_s = 0.0
        # Progress (stalled_s): requests in vLLM now, and when it last answered one. A request its
        # caller gave up on (cancelled) is no answer: a hung core's callers time out and try again.
        self._in_engine = 0
        self._answered_at = time.monotonic()
        self._unanswered = False  # a request was given up on since the last answer

    async def start(self) -> None:
        """Make the vLLM engine (paused until `open` or `resume`). An engine core that fails to start
        raises EngineStartError with the root cause its process logged."""
        logged_from = core_start.stderr_offset()
        try:
            self._llm = vc.make_engine(self.spec)
        except Exception as exc:
            if (line := core_start.explain(exc, core_start.read_since(logged_from))) is not None:
                raise core_start.EngineStartError(line) from exc
            raise
        if self.spec.routes is not None and self.spec.device != "cuda":  # CUDA: vLLM's native capture
            await engine_routes.start(self._llm, self.spec.routes)
        if self.spec.lora is not None:  # every request names the served adapter: it exists from the start
            await vc.install_zero_adapter(self._llm, self.spec.lora)

    @property
    def started(self) -> bool:
        return self._llm is not None

    # ---- generation ------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._running.is_set()

    async def wait_running(self) -> None:
        await self._running.wait()

    async def generate(
        self, token_ids: list[int], params: Any, request_id: str, text: str = "", images: list[bytes] | None = None,
        images_span: int = 0,
    ) -> Generation:
        """One request, started only while the model runs (never in the middle of a weight update).
        `params`: vLLM's sampling parameters (`vc.params_for`); `token_ids` empty: vLLM renders `text`;
        `images`: a vision-language prompt's encoded images (`token_ids` hold their expanded placeholders);
        `images_span`: a multi-turn episode's tokens up to its last image's placeholders (0: the prompt's)."""
        await self._running.wait()
        start = self.version
        pixels = prompt_images(images or [], self.spec.images, images_span)
        prompt_ids, completions = await self._answered(
            vc.generate(self._llm, vc.generation_input(token_ids, text, pixels), params, request_id, pixels)
        )
        if self.spec.routes is not None:
            await engine_routes.attach(self._llm, self.spec.routes, len(prompt_ids), completions)
        # The lowest and highest versions, not the start's and the end's: a learner recovery syncs an
        # older checkpoint's weights (version 30 after 31), and a request kept across that sync would
        # otherwise end before it began, a frame the buffer rejects (its samples counted lost).
        return Generation(prompt_ids, completions, min(start, self.version), max(start, self.version))

    async def score_tokens(
        self, token_ids: list[int], request_id: str, images: list[bytes] | None = None, prompt_len: int = 0
    ) -> list[float]:
        """vLLM's log-prob of every token given the ones before it (first entry: nan), with the
        weights served now; fails at once when the engine core dies. `images`: the images of the
        prompt that the first `prompt_len` tokens render."""
        pixels = prompt_images(images or [], self.spec.images)
        scored = vc.score_tokens(self._llm, token_ids, request_id, pixels, prompt_len)
        return await self._answered(vc.watched(self._llm, scored, "score"))

    async def _answered(self, call: Awaitable[T]) -> T:
        """`call`, a request to vLLM, counted for `stalled_s`."""
        if self._in_engine == 0 and not self._unanswered:
            self._answered_at = time.monotonic()  # a busy spell begins: the clock starts now
        self._in_engine += 1
        try:
            result = await call
        except asyncio.CancelledError:
            self._unanswered = True
            raise
        except BaseException:
            self._answer()  # vLLM answered, with an error
            raise
        finally:
            self._in_engine -= 1
        self._answer()
        return result

    def _answer(self) -> None:
        self._answered_at = time.monotonic()
        self._unanswered = False

    def stalled_s(self) -> float:
        """How long vLLM has held requests without answering any (0.0 while it holds none). A hung
        engine core (stopped, or stuck) answers nothing however long its callers retry; a slow one
        answers some."""
        return time.monotonic() - self._answered_at if self._in_engine else 0.0

    async def watched(self, call: Awaitable[T], what: str) -> T:
        """`call`, failed (vc.EngineDied) the moment the engine core dies instead of never."""
        return await vc.watched(self._llm, call, what)

    # ---- pause, sleep, resume --------------------------------------------------------------------

    def hold(self) -> None:
        """New requests wait from now on (those in flight are `pause`'s to keep or abort)."""
        self._running.clear()
        if self._paused_since is None:
            self._paused_since = time.monotonic()

    def open(self) -> None:
        """Serve: requests start from now on."""
        self._running.set()
        if self._paused_since is not None:
            self._paused_s += time.monotonic() - self._paused_since
            self._paused_since = None

    async def pause(self) -> None:
        self.hold()
        if self._asleep:
            # The weights must be back before an update loads into them, but only they: vLLM resumes
            # its scheduler once every allocation is resident (wake_up), which would let the kept
            # requests generate on the old weights until a pause. With the KV cache still asleep the
            # scheduler stays paused (sleep paused it, in keep mode, caches cleared); `resume` wakes it.
            await vc.wake_up(self._llm, [vc.WEIGHTS])
            self._asleep, self._kv_asleep = False, True
            return
        await vc.pause(self._llm, self.pause_mode)  # also for a never-resumed engine: harmless

    async def sleep(self) -> None:
        """Colocated placement: pause, and on GPU release vLLM's memory to the learner."""
        await self.pause()
        self._asleep = await vc.sleep(self._llm)

    async def resume(self, version: int) -> None:
        """Serve the weights of `version` (loaded while paused)."""
        self.version = version
        if self._kv_asleep:  # the new weights are in: the KV cache back, and with it the scheduler
            await vc.wake_up(self._llm, [vc.KV_CACHE])
            self._kv_asleep = False
        await vc.resume(self._llm)
        self.open()

    @property
    def paused_s(self) -> float:
        """Time held or asleep so far (weight syncs; colocated: the learner's turn)."""
        held = time.monotonic() - self._paused_since if self._paused_since is not None else 0.0
        return self._paused_s + held

    # ---- weights ---------------------------------------------------------------------------------

    async def join_weight_group(self, info: WeightGroupInfo, first_rank: int, manifest: Manifest) -> None:
        await vc.join_weight_group(self._llm, info, first_rank, manifest)

    async def receive_weights(self, version: int, adapter_slot: int) -> list[UpdateReceipt]:
        """One update from the weight group; with LoRA the adapter alone, into `adapter_slot`."""
        if self.spec.lora is not None:
            return await vc.receive_adapter(self._llm, version, self.spec.lora, adapter_slot)
        return await vc.receive_weights(self._llm, version)

    async def param_checksums(self) -> list[ShardChecksum]:
        return await vc.param_checksums(self._llm)

    async def model_runner(self) -> str:
        return await vc.model_runner(self._llm)

    # ---- health and processes --------------------------------------------------------------------

    def dead(self) -> bool:
        """True once vLLM's engine core died (the process holding this object cannot generate any more)."""
        return vc.is_dead(self._llm)

    def death_line(self) -> str:
        """That vLLM's engine core died, with its exit code in words where known."""
        return core_watch.death_line(self._llm)

    def engine_core_pids(self) -> list[int]:
        return vc.engine_core_pids(self._llm) if self._llm is not None else []

    def kill_engine_core(self) -> list[int]:
        """SIGKILL vLLM's processes (a hung core does not answer a shutdown); returns their pids. vLLM
        then finds its core gone, and `dead()` says so."""
        pids = self.engine_core_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def shutdown(self) -> None:
        """Shut vLLM down (its engine process included); waiting requests are let go."""
        self._running.set()
        if self._llm is not None:
            vc.shutdown(self._llm)
            self._llm = None
