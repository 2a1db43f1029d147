"""A sequence-classification reward model replica: a Ray actor that loads an
AutoModelForSequenceClassification and scores inputs in batches, served over HTTP
(`POST /v1/classify`, the run's key) to the reward workers.

The reward of one input is read from the model's outputs for it (task.classifier): `logit` gives
output[label] as it is (a model with one output, num_labels=1, is a regression head: its value),
`sigmoid` gives sigmoid(output[label]), `softmax` the probability of `label` over all outputs.

Batching: every request's inputs join one queue; a batch takes the first waiting input and whatever
else arrives within `batch_wait_ms`, up to `max_batch`, and is scored in one forward pass on a
helper thread (one at a time: the event loop keeps accepting requests meanwhile)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import msgspec

from async_rl.reward_models.server import (
    CLASSIFIER,
    ClassifyInput,
    ClassifyReply,
    ClassifyRequest,
    ReplicaPids,
    ReplicaStats,
    RewardEndpoint,
    RewardModelServer,
    bearer_auth,
    bind_address,
    serve_app,
)


class ClassifierModel:
    """The model and tokenizer of one replica, and how its inputs become rewards."""

    def __init__(
        self, folder: str, dtype: str, device: str, input_mode: str, label: int, transform: str, max_length: int
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch_dtype).to(device).eval()
        self.device = device
        self.input_mode = input_mode
        self.label = label
        self.transform = transform
        self.max_length = max_length

    def text(self, item: ClassifyInput) -> str:
        """What the model reads for one input (task.classifier.input)."""
        if self.input_mode == "text":
            return item.completion
        if self.tokenizer.chat_template:
            chat = [{"role": "user", "content": item.question}, {"role": "assistant", "content": item.completion}]
            return self.tokenizer.apply_chat_template(chat, tokenize=False)
        return f"{item.question}\n{item.completion}"

    def score(self, items: Sequence[ClassifyInput]) -> list[float]:
        """One forward pass over `items`; a reward per input."""
        import torch

        rows = [self.tokenizer(self.text(i), add_special_tokens=False)["input_ids"][-self.max_length:] for i in items]
        width = max(len(r) for r in rows)
        # Decoder classifiers (Llama, Qwen2 ...ForSequenceClassification) pool the last token that is not
        # config.pad_token_id. A real pad id may also end a text (pad = EOS = the chat template's end of turn,
        # as in SmolLM2), which would move the pooled position: pad with an id no row contains instead.
        used = {t for r in rows for t in r}
        pad = next(t for t in range(self.model.config.vocab_size - 1, -1, -1) if t not in used)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
        self.model.config.pad_token_id = pad
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        if self.transform == "softmax":
            chosen = logits.softmax(-1)[:, self.label]
        elif self.transform == "sigmoid":
            chosen = logits[:, self.label].sigmoid()
        else:
            chosen = logits[:, self.label]
        return chosen.tolist()


class Batcher:
    """Gathers inputs from concurrent requests into batches for `score` (see the module doc)."""

    def __init__(self, score, max_batch: int, wait_s: float) -> None:
        self._score = score
        self.max_batch = max_batch
        self.wait_s = wait_s
        self._queue: asyncio.Queue[tuple[ClassifyInput, asyncio.Future]] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._pending: set[asyncio.Future] = set()  # every input not answered yet (queued or being scored)
        self.batches = 0
        self.largest = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for f in list(self._pending):  # their requests answer now (an error), not at the server's shutdown timeout
            if not f.done():
                f.set_exception(RuntimeError("the classifier replica is stopping"))

    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def score(self, items: list[ClassifyInput]) -> list[float]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        for item, future in zip(items, futures, strict=True):
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)
            self._queue.put_nowait((item, future))
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.wait_s
            while len(batch) < self.max_batch:
                left = deadline - loop.time()
                try:
                    batch.append(self._queue.get_nowait() if left <= 0 else await asyncio.wait_for(self._queue.get(), left))
                except (asyncio.QueueEmpty, TimeoutError):
                    break
            live = [(item, f) for item, f in batch if not f.done()]  # a caller that gave up is not scored
            if not live:
                continue
            try:
                scores = await loop.run_in_executor(None, self._score, [item for item, _ in live])
            except Exception as exc:
                for _, f in live:
                    if not f.done():
                        f.set_exception(RuntimeError(f"the classifier failed on a batch of {len(live)}: {exc}"))
                continue
            self.batches += 1
            self.largest = max(self.largest, len(live))
            for (_, f), value in zip(live, scores, strict=True):
                if not f.done():
                    f.set_result(value)


class ClassifierSettings(msgspec.Struct, frozen=True):
    replica_id: int
    folder: str
    key: str
    device: str  # 'cuda' or 'cpu' (resolved)
    dtype: str  # resolved: float32 | bfloat16 | float16
    threads: int
    input_mode: str
    label: int
    transform: str
    max_length: int
    max_batch: int
    batch_wait_ms: float
    host: str = "127.0.0.1"  # the address the endpoint binds ('' = its node's IP: reward workers on other nodes)

    def __repr__(self) -> str:
        return f"ClassifierSettings(replica {self.replica_id}, {self.folder}, key <redacted>)"


class ClassifierServer(RewardModelServer):
    def __init__(self, settings: ClassifierSettings) -> None:
        self.s = settings
        self._stats = ReplicaStats(settings.replica_id)
        self._batcher: Batcher | None = None
        self._runner = None

    async def start(self) -> RewardEndpoint:
        import torch
        from aiohttp import web

        s = self.s
        torch.set_num_threads(s.threads)
        model = await asyncio.get_running_loop().run_in_executor(
            None,
            lambda: ClassifierModel(s.folder, s.dtype, s.device, s.input_mode, s.label, s.transform, s.max_length),
        )
        self._batcher = Batcher(model.score, s.max_batch, s.batch_wait_ms / 1000)
        self._batcher.start()
        app = web.Application(middlewares=[bearer_auth(self.s.key, self._refused)], client_max_size=64 << 20)
        app.router.add_post("/v1/classify", self._classify)
        host = bind_address(s.host)
        self._runner, port = await serve_app(app, host)
        return RewardEndpoint(CLASSIFIER, s.replica_id, f"http://{host}:{port}/v1", s.key, os.path.basename(s.folder))

    def _refused(self) -> None:
        self._stats.refused += 1

    async def _classify(self, request):
        from aiohttp import web

        try:
            req = msgspec.json.decode(await request.read(), type=ClassifyRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return web.json_response({"error": {"message": f"bad request body: {exc}", "code": 400}}, status=400)
        if not req.inputs:
            return web.json_response({"error": {"message": "inputs is empty", "code": 400}}, status=400)
        assert self._batcher is not None
        try:
            scores = await self._batcher.score(req.inputs)
        except RuntimeError as exc:
            return web.json_response({"error": {"message": str(exc), "code": 500}}, status=500)
        self._stats.requests += 1
        return web.Response(body=msgspec.json.encode(ClassifyReply(scores)), content_type="application/json")

    def healthy(self) -> bool:
        return self._batcher is not None and self._batcher.running()

    def stats(self) -> ReplicaStats:
        b = self._batcher
        return msgspec.structs.replace(self._stats, batches=b.batches if b else 0, max_batch=b.largest if b else 0)

    def pids(self) -> ReplicaPids:
        return ReplicaPids(actor=os.getpid(), engine_core=[])

    async def shutdown(self) -> None:
        if self._batcher is not None:
            await self._batcher.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
