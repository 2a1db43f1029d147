"""GeneratorEngine: a Ray async actor that owns one vLLM AsyncLLM and keeps it full.

Loop: lease prompts from the buffer (admission control decides), submit each as a request for
`group_size` samples with per-token behaviour log-probs, score the finished group off the event
loop, push it to the buffer over ZMQ. The controller pauses the engine for weight updates; requests
in flight are kept (pause mode 'keep') and every sample records the first and last policy version
that produced its tokens.

With an environment (`env` config), each prompt's group is `group_size` multi-turn episodes
(`envs/episode.py`): every model turn is one vLLM request from the running token ids, started only
while the engine runs (a turn waits out a pause before it starts). A turn cut by an abort-mode pause
is resubmitted from where it stopped like a single-turn completion (its rest comes from the new
weights), so an episode survives every pause mode. The episode's final reward goes through the
reward worker processes.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import time

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from async_rl.agents.episodes import AgentCounters
from async_rl.config import EnvConfig, TaskConfig
from async_rl.envs.base import Environment
from async_rl.envs.episode import ChatDelta, EpisodeResult, ModelTurn, run_episode
from async_rl.evaluation.scores import EvalBatch, EvalParams, EvalResult
from async_rl.generator import vllm_compat as vc
from async_rl.generator.lora_serving import SERVED_LORA_ID
from async_rl.generator.rewards import RewardRunner
from async_rl.generator.sampling import SamplingSpec, stop_token_ids
from async_rl.learner.base import Probe
from async_rl.protocol import (
    FINISH_LENGTH,
    FINISH_REASONS,
    FINISH_STOP,
    REWARD_OK,
    TOKEN_DTYPE,
    ChatMessage,
    EpisodeInfo,
    Prompt,
    Sample,
    TrajectoryGroup,
    encode_groups,
)
from async_rl.reward_models.calls import RewardModelCounts
from async_rl.reward_models.server import RewardEndpoint
from async_rl.security import ClientKeys, harden_client
from async_rl.weight_sync.base import UpdateReceipt, WeightGroupInfo
from async_rl.weight_sync.bucketing import Manifest
from async_rl.weight_sync.checksum import ShardChecksum


class EngineSettings(msgspec.Struct, frozen=True):
    engine_id: int
    run_id: str
    spec: vc.EngineSpec
    cores: list[int]
    kv_cache_gib: float
    group_size: int
    max_tokens: int
    temperature: float
    max_inflight_prompts: int
    pause_mode: str
    task: TaskConfig  # the reward workers rebuild the reward function from it
    reward_timeout_s: float
    reward_workers: int
    ingest_address: str
    curve: ClientKeys | None = None  # the engine's CURVE keys (None: security.curve is off)
    ignore_eos: bool = False
    threads: int = 1  # vLLM's OpenMP threads when `cores` is empty (not pinned)
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: list[str] = []  # stop strings; the model's EOS/stop tokens are read from model_dir
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)  # multi-turn episodes (env.name '' = single-turn samples)
    endpoint_host: str = "127.0.0.1"  # env=agent: the address the engine's OpenAI endpoint binds (its agents run here)
    reward_endpoints: list[RewardEndpoint] = []  # task.reward=judge:/classifier: the reward model's replicas


# An episode's finish -> the wire's: the environment ended it or its turns ran out ('stop'), the
# token budget cut it ('length'), a turn was aborted and not resumed ('abort').
EPISODE_FINISH = {"stop": FINISH_STOP, "max_turns": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_REASONS["abort"]}

# The reward status of the episode the current task runs (each episode runs in its own task).
_episode_reward_status: contextvars.ContextVar[list[int]] = contextvars.ContextVar("episode_reward_status")


def finish_code(reason: str, prompt_id: int) -> int:
    """vLLM's finish reason -> its wire code. Another reason (vLLM's 'error') fails the request, which
    the buffer counts as lost, instead of passing for a clean stop."""
    if reason not in FINISH_REASONS:
        raise RuntimeError(f"prompt {prompt_id}: vLLM finished a completion with reason {reason!r}")
    return FINISH_REASONS[reason]


class EngineStats(msgspec.Struct):
    engine_id: int
    version: int
    groups_pushed: int
    samples_pushed: int
    tokens_generated: int
    inflight: int
    paused: bool
    idle_s: float  # time with nothing in flight since start (waiting on admission)
    failed_requests: int
    last_error: str
    paused_s: float = 0.0  # time paused or asleep (weight syncs; colocated: the learner's turn)
    reward_pool_restarts: int = 0  # reward pools found wedged or broken and started anew
    reward_last_error: str = ""  # why the last reward that was not ok failed (the exception's last line)
    agents: AgentCounters | None = None  # env=agent: episodes, calls, prefix breaks, agent failures
    reward_model: RewardModelCounts | None = None  # task.reward=judge:/classifier: its calls by outcome


class EnginePids(msgspec.Struct, frozen=True):
    """Operating-system processes of one engine (operators and crash tests kill them by pid)."""

    actor: int  # the Ray actor process (owns AsyncLLM, the reward threads, the ZMQ socket)
    engine_core: list[int]  # vLLM's processes under the actor (engine core, workers)


class GeneratorEngine:
    def __init__(self, settings: EngineSettings, buffer) -> None:
        self.s = settings
        self.buffer = buffer
        # vLLM reads these when its engine process starts: set them before it does.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(settings.kv_cache_gib))))
        if settings.cores:
            vc.bind_engine_to(settings.cores, settings.spec.tensor_parallel_size)
        else:
            vc.leave_engine_unbound(settings.threads, settings.spec.tensor_parallel_size)
        self.version = 0
        self._llm = None
        self._running = asyncio.Event()
        self._stop = False
        self._inflight: dict[str, asyncio.Task] = {}
        self._requests = 0  # request ids are e{engine}-r{n}-p{prompt}: unique for the run, also when a
        # restarted buffer leases a prompt id again (engine ids are never reused within a run)
        self._loop_task: asyncio.Task | None = None
        self._groups = 0
        self._samples = 0
        self._tokens = 0
        self._idle_s = 0.0
        self._failed = 0
        self._last_error = ""
        self._asleep = False
        self._kv_asleep = False  # woken for a weight update (weights only): the KV cache comes back at resume
        self._draining = False
        self._paused_since: float | None = None
        self._paused_s = 0.0
        self._evals = 0  # evaluation calls served (request ids stay unique)
        # learner.lora: the LoRA id an update is loaded into; the one requests name (lora_serving). Kept
        # apart so a test can deliver into another id (verl #7495's failure) and see the sync refuse it.
        self.adapter_slot = SERVED_LORA_ID
        self.agents = None  # env=agent: AgentEpisodes (async_rl/agents/), with the engine's endpoint

    async def start(self, paused: bool = False) -> None:
        """Start vLLM; a `paused` engine generates only after its first `resume` (new weights)."""
        self.rewards = RewardRunner(
            self.s.task, self.s.reward_timeout_s, self.s.reward_workers, on_restart=self._reward_pool_restarted
        )
        self.rewards.endpoints = list(self.s.reward_endpoints)
        # Its fork server and workers start here, off the event loop (Ray calls keep being served).
        await asyncio.get_running_loop().run_in_executor(None, self.rewards.start)
        self._llm = vc.make_engine(self.s.spec)
        if self.s.spec.lora is not None:  # every request names the served adapter: it exists from the start
            await vc.install_zero_adapter(self._llm, self.s.spec.lora)
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        harden_client(self._push, self.s.curve)
        self._push.connect(self.s.ingest_address)
        self.sampling = SamplingSpec(
            n=self.s.group_size,
            max_tokens=self.s.max_tokens,
            temperature=self.s.temperature,
            top_p=self.s.top_p,
            top_k=self.s.top_k,
            min_p=self.s.min_p,
            stop=list(self.s.stop),
            stop_token_ids=[] if self.s.ignore_eos else stop_token_ids(self.s.spec.model_dir),
            ignore_eos=self.s.ignore_eos,
        )
        self._params = vc.params_for(self.sampling)
        self.env: Environment | None = None
        if self.s.env.name.startswith(("agent:", "verifiers:")):  # verifiers:ID runs as an agent (verifiers_env.py)
            from async_rl.agents.setup import start_agents

            self.agents = await start_agents(self, self.s)
        elif self.s.env.name:
            from async_rl.envs.factory import build_environment

            self.env = build_environment(self.s.env, self._episode_reward)
            self._delta = self._chat_delta()
        if paused:
            self._paused_since = time.monotonic()
        else:
            self._running.set()
        self._loop_task = asyncio.create_task(self._generate_loop())

    async def _generate_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop and not self._draining:
            try:
                await self._running.wait()
                free = self.s.max_inflight_prompts - len(self._inflight)
                if free <= 0:
                    await asyncio.wait(list(self._inflight.values()), return_when=asyncio.FIRST_COMPLETED)
                    continue
                t0 = loop.time()
                prompts: list[Prompt] = await self.buffer.lease.remote(self.s.engine_id, free, 0.5)
                if not self._inflight and not prompts:
                    self._idle_s += loop.time() - t0
                for p in prompts:
                    self._requests += 1
                    rid = f"e{self.s.engine_id}-r{self._requests}-p{p.prompt_id}"
                    self._inflight[rid] = asyncio.create_task(self._run_prompt(p, rid))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a failed lease call must not end generation silently
                self._last_error = f"lease: {type(exc).__name__}: {exc}"
                self._failed += 1
                await asyncio.sleep(1.0)

    async def _run_prompt(self, prompt: Prompt, request_id: str) -> None:
        try:
            await self._running.wait()
            if self.env is not None or self.agents is not None:
                await self._push_group(await self._run_episodes(prompt, request_id, self.sampling, self.s.group_size))
                return
            version_first = self.version
            prompt_ids, completions, scored = await self._generate_scored(prompt, self._params, request_id)
            version_last = self.version
            group = TrajectoryGroup(
                prompt_id=prompt.prompt_id,
                engine_id=self.s.engine_id,
                prompt_tokens=np.asarray(prompt_ids, dtype=TOKEN_DTYPE),
                completions=[np.asarray(c.token_ids, dtype=TOKEN_DTYPE) for c in completions],
                logprobs=[np.asarray(c.logprobs, dtype=np.float32) for c in completions],
                rewards=[r for r, _ in scored],
                version_first=[version_first] * len(completions),
                version_last=[version_last] * len(completions),
                reward_status=[st for _, st in scored],
                finish_reasons=[finish_code(c.finish_reason, prompt.prompt_id) for c in completions],
            )
            await self._push_group(group)
        except Exception as exc:  # one bad request must not stop the engine; the buffer counts it lost
            self._failed += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            if vc.is_dead(self._llm):
                return  # vLLM itself died: the controller replaces this engine and requeues its leases
            try:
                await self.buffer.mark_lost.remote(self.s.engine_id, [prompt.prompt_id])
            except Exception as lost_exc:
                self._last_error += f"; mark_lost failed: {lost_exc}"
        finally:
            self._inflight.pop(request_id, None)

    async def _push_group(self, group: TrajectoryGroup) -> None:
        await self._push.send_multipart(encode_groups(self.s.run_id, [group]))
        self._groups += 1
        self._samples += group.episode_count  # episodes (a split agent episode's segments count once)
        masks = group.loss_masks or [None] * group.size
        self._tokens += sum(len(c) if m is None else int(m.sum()) for c, m in zip(group.completions, masks, strict=True))

    # ---- multi-turn episodes ---------------------------------------------------------------------

    def _chat_delta(self) -> ChatDelta:
        """Renders an environment turn's messages (and the next assistant header) as tokens. The model's
        turn ends with one of its stop tokens: the first the chat template ends an assistant turn with."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.s.spec.model_dir)
        errors = []
        for token in self.sampling.stop_token_ids:
            try:
                return ChatDelta(tokenizer, token)
            except ValueError as exc:
                errors.append(str(exc))
        raise RuntimeError(f"env={self.s.env.name}: cannot render environment turns: {'; '.join(errors) or 'no stop token'}")

    async def _episode_reward(self, sample: Sample) -> float:
        """The environment's reward function: the task's reward in the reward worker processes. Its
        status (timeout, crash) is kept for the episode being run."""
        value, status = await self.rewards.score(sample)
        holder = _episode_reward_status.get(None)
        if holder is not None:
            holder[0] = status
        return value

    async def _run_episodes(self, prompt: Prompt, request_id: str, sampling: SamplingSpec, n: int) -> TrajectoryGroup:
        """`n` episodes of `prompt` as one group; each model turn samples with `sampling` (its max_tokens
        bounds a turn)."""
        if self.agents is not None:
            return await self.agents.run_group(prompt, request_id, sampling, n, self.version)
        if not prompt.token_ids:
            raise RuntimeError(f"prompt {prompt.prompt_id}: an episode needs the rendered prompt tokens")
        messages = list(prompt.messages) or [ChatMessage("user", prompt.text)]
        limit = self.s.env.max_total_tokens or self.s.spec.max_model_len
        runs = await asyncio.gather(
            *(self._episode(prompt, messages, limit, f"{request_id}-s{i}", sampling) for i in range(n))
        )
        results = [r for r, _, _ in runs]
        if any(not r.turn_versions for r in results):
            raise RuntimeError(
                f"prompt {prompt.prompt_id}: its {len(prompt.token_ids)} tokens leave no room for a model turn "
                f"under env.max_total_tokens={limit}"
            )
        return TrajectoryGroup(
            prompt_id=prompt.prompt_id,
            engine_id=self.s.engine_id,
            prompt_tokens=np.asarray(prompt.token_ids, dtype=TOKEN_DTYPE),
            completions=[np.asarray(r.completion_ids, dtype=TOKEN_DTYPE) for r in results],
            logprobs=[np.asarray(r.logprobs, dtype=np.float32) for r in results],
            rewards=[r.reward for r in results],
            version_first=[r.turn_versions[0] for r in results],
            version_last=[last for _, last, _ in runs],
            reward_status=[st for _, _, st in runs],
            finish_reasons=[EPISODE_FINISH[r.finish_reason] for r in results],
            loss_masks=[np.asarray(r.loss_mask, dtype=np.uint8) for r in results],
            episodes=[
                EpisodeInfo(
                    turns=r.turns,
                    tool_calls=r.tool_calls,
                    tool_errors=r.tool_errors,
                    tool_timeouts=r.tool_outcomes.get("timeout", 0),
                    tool_ok=r.tool_outcomes.get("ok", 0),
                    turn_versions=list(r.turn_versions),
                )
                for r in results
            ],
        )

    async def _episode(
        self, prompt: Prompt, messages: list[ChatMessage], limit: int, request_id: str, sampling: SamplingSpec
    ) -> tuple[EpisodeResult, int, int]:
        """One episode: (result, policy version when its last model turn ended, reward status)."""
        status = [REWARD_OK]
        _episode_reward_status.set(status)  # this coroutine runs in its own task: its own context
        last_version = [self.version]
        turns = [0]

        async def generate(ids: list[int], budget: int) -> ModelTurn:
            await self._running.wait()  # a turn starts only while the engine runs (not mid weight update)
            version = self.version
            turns[0] += 1
            params = vc.params_for(
                msgspec.structs.replace(sampling, n=1, max_tokens=min(sampling.max_tokens, budget))
            )
            _, (c,) = await vc.generate(self._llm, vc.generation_input(ids, ""), params, f"{request_id}-t{turns[0]}")
            last_version[0] = self.version
            return ModelTurn(c.token_ids, c.logprobs, c.text, c.finish_reason, version)

        result = await run_episode(
            self.env.start(prompt), list(prompt.token_ids), messages, generate, self._delta, self.s.env.max_turns, limit
        )
        return result, last_version[0], status[0]

    async def _generate_scored(self, prompt: Prompt, params, request_id: str):
        """One request: (prompt token ids, completions, (reward, status) per completion)."""
        source = vc.generation_input(prompt.token_ids, prompt.text)
        prompt_ids, completions = await vc.generate(self._llm, source, params, request_id)
        if prompt.token_ids and prompt_ids != list(prompt.token_ids):
            raise RuntimeError(f"prompt {prompt.prompt_id}: vLLM generated from other tokens than the rendered ones")
        scored = await asyncio.gather(
            *(
                self.rewards.score(
                    Sample(prompt=prompt, completion=c.text, completion_ids=c.token_ids, finish_reason=c.finish_reason)
                )
                for c in completions
            )
        )
        return prompt_ids, completions, scored

    # ---- evaluation (called by the controller) ---------------------------------------------------

    async def evaluate(self, prompts: list[Prompt], params: EvalParams) -> EvalBatch:
        """Generate and score `prompts` beside the training requests and return the scores to the
        caller. Nothing is pushed to the buffer and the training counters do not move."""
        await self._running.wait()
        version = self.version
        self._evals += 1
        episodic = self.env is not None or self.agents is not None
        evaluate_prompt = self._evaluate_episodes if episodic else self._evaluate_completions
        prefix = f"e{self.s.engine_id}-eval{self._evals}"
        outcomes = await asyncio.gather(
            # watched: a prompt in flight when the engine core dies fails at once, not never
            *(vc.watched(self._llm, evaluate_prompt(p, params, f"{prefix}-p{p.prompt_id}"), "eval") for p in prompts),
            return_exceptions=True,
        )
        results, failed = [], 0
        for out in outcomes:
            if isinstance(out, BaseException):  # counted and reported; the other prompts' scores stand
                failed += 1
                self._last_error = f"eval: {type(out).__name__}: {out}"
                continue
            results.append(out)
        if vc.is_dead(self._llm):  # the prompts without a result failed with the engine, not on their own
            return EvalBatch(self.s.engine_id, version, self.version, results, engine_died=True)
        return EvalBatch(
            engine_id=self.s.engine_id, version=version, version_last=self.version, results=results, failed_prompts=failed
        )

    async def _evaluate_completions(self, prompt: Prompt, params: EvalParams, request_id: str) -> EvalResult:
        """`params.n` completions of `prompt`, scored; the training sampler's stop tokens and strings
        with the eval's n, temperature and length."""
        sampling = vc.params_for(
            msgspec.structs.replace(
                self.sampling, n=params.n, temperature=params.temperature, max_tokens=params.max_tokens
            )
        )
        _, completions, scored = await self._generate_scored(prompt, sampling, request_id)
        return EvalResult(
            prompt_id=prompt.prompt_id,
            data_source=prompt.data_source,
            rewards=[r for r, _ in scored],
            completion_lens=[len(c.token_ids) for c in completions],
            finish_reasons=[FINISH_REASONS.get(c.finish_reason, 0) for c in completions],
            reward_failures=sum(1 for _, st in scored if st != REWARD_OK),
        )

    async def _evaluate_episodes(self, prompt: Prompt, params: EvalParams, request_id: str) -> EvalResult:
        """`params.n` whole episodes of `prompt` in the environment: the episode's reward; its length
        counts every completion token, the environment's too."""
        sampling = msgspec.structs.replace(
            self.sampling, n=1, temperature=params.temperature, max_tokens=params.max_tokens
        )
        group = await self._run_episodes(prompt, request_id, sampling, params.n)
        last = group.episode_last_samples()  # per episode (a split agent episode: its last segment)
        return EvalResult(
            prompt_id=prompt.prompt_id,
            data_source=prompt.data_source,
            rewards=[group.rewards[i] for i in last],
            completion_lens=[len(group.completions[i]) for i in last],
            finish_reasons=[group.finish_reasons[i] for i in last] if group.finish_reasons else [],
            reward_failures=sum(1 for i in last if group.reward_status[i] != REWARD_OK),
        )

    # ---- membership (called by the controller) ---------------------------------------------------

    async def drain(self, timeout_s: float) -> int:
        """Take no new lease; let the requests in flight finish (up to `timeout_s`). Returns how many
        are still unfinished; the controller hands their leases back to the prompt pool."""
        self._draining = True
        pending = list(self._inflight.values())
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        return len(self._inflight)

    def pids(self) -> EnginePids:
        return EnginePids(actor=os.getpid(), engine_core=vc.engine_core_pids(self._llm))

    async def watch(self) -> str:
        """Returns (why) once this engine cannot serve: its vLLM engine core died or its reward pool
        is stuck. The supervisor keeps one call pending; it also fails (RayActorError) the moment the
        actor itself dies. Either way death is noticed within a poll here, not at the supervisor's
        next health check."""
        while self._stop or self._llm is None or self.healthy():
            await asyncio.sleep(vc.DEATH_POLL_S)
        return "vLLM's engine core died" if vc.is_dead(self._llm) else "its reward pool makes no progress"

    def healthy(self) -> bool:
        """False once vLLM's engine core died (the actor alone cannot generate any more), or once its
        reward pool can make no progress (a restart failed, or calls waited far past one)."""
        return self._llm is not None and not vc.is_dead(self._llm) and self.rewards.healthy()

    def _reward_pool_restarted(self, reason: str) -> None:
        self._last_error = f"reward pool restarted: {reason}"
        self.buffer.reward_pool_restarted.remote(self.s.engine_id)  # counted there; a dead buffer misses one

    async def reconnect(self, buffer, ingest_address: str) -> None:
        """A restarted buffer: lease from the new actor, push to its new ingest socket. The requests
        in flight are cancelled: the new buffer handed every lease it restored back to the prompt
        pool and never knew the later ones, so their groups could only be rejected."""
        stale = list(self._inflight.values())
        for t in stale:
            t.cancel()
        await asyncio.gather(*stale, return_exceptions=True)
        self.buffer = buffer
        old = self._push
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        harden_client(self._push, self.s.curve)  # the restarted buffer has the same run keys
        self._push.connect(ingest_address)
        old.close(linger=0)

    # ---- weight updates (called by the controller) -----------------------------------------------

    async def pause(self) -> None:
        self._running.clear()
        if self._paused_since is None:
            self._paused_since = time.monotonic()
        if self._asleep:
            # The weights must be back before an update loads into them, but only they: vLLM resumes
            # its scheduler once every allocation is resident (wake_up), which would let the kept
            # requests generate on the old weights until a pause. With the KV cache still asleep the
            # scheduler stays paused (sleep paused it, in keep mode, caches cleared); `resume` wakes it.
            await vc.wake_up(self._llm, [vc.WEIGHTS])
            self._asleep, self._kv_asleep = False, True
            return
        await vc.pause(self._llm, self.s.pause_mode)  # also for a never-resumed engine: harmless

    async def sleep(self) -> None:
        """Colocated placement: pause, and on GPU release vLLM's memory to the learner."""
        await self.pause()
        self._asleep = await vc.sleep(self._llm)

    async def resume(self, version: int) -> None:
        self.version = version
        if self._kv_asleep:  # the new weights are in: the KV cache back, and with it the scheduler
            await vc.wake_up(self._llm, [vc.KV_CACHE])
            self._kv_asleep = False
        await vc.resume(self._llm)
        self._running.set()
        if self._paused_since is not None:
            self._paused_s += time.monotonic() - self._paused_since
            self._paused_since = None

    async def join_weight_group(self, info: WeightGroupInfo, first_rank: int, manifest: Manifest) -> None:
        await vc.join_weight_group(self._llm, info, first_rank, manifest)

    async def receive_weights(self, version: int) -> list[UpdateReceipt]:
        if self.s.spec.lora is not None:  # the adapter alone, into the slot every request names
            return await vc.receive_adapter(self._llm, version, self.s.spec.lora, self.adapter_slot)
        return await vc.receive_weights(self._llm, version)

    async def param_checksums(self) -> list[ShardChecksum]:
        return await vc.param_checksums(self._llm)

    async def logprobs(self, probe: Probe) -> list[list[float]]:
        """vLLM's log-probs of the probe's tokens at its positions, with the weights served now (the
        probe's own log-probs are not read)."""
        out: list[list[float]] = []
        for i, (ids, positions) in enumerate(zip(probe.token_ids, probe.positions, strict=True)):
            rid = f"e{self.s.engine_id}-probe-v{self.version}-{i}"
            ours = await vc.watched(self._llm, vc.score_tokens(self._llm, ids, rid), "score")
            out.append([ours[p] for p in positions])
        return out

    async def score(self, probe: Probe) -> float:
        """Mean |vLLM - learner| log-prob over the probe's tokens, both at the current version."""
        ours = await self.logprobs(probe)
        diffs = [
            abs(v - lp)
            for vllm_lps, learner_lps in zip(ours, probe.logprobs, strict=True)
            for v, lp in zip(vllm_lps, learner_lps, strict=True)
        ]
        return sum(diffs) / len(diffs) if diffs else 0.0

    def sampling_spec(self) -> SamplingSpec:
        """What this engine samples with (stop tokens resolved from the model's generation config)."""
        return self.sampling

    def set_reward_endpoints(self, endpoints: list[RewardEndpoint]) -> None:
        """The reward model's replicas changed (a dead one was restarted at a new address): calls from
        now on go to these."""
        self.rewards.endpoints = list(endpoints)

    def stats(self) -> EngineStats:
        return EngineStats(
            engine_id=self.s.engine_id,
            version=self.version,
            groups_pushed=self._groups,
            samples_pushed=self._samples,
            tokens_generated=self._tokens,
            inflight=len(self._inflight),
            paused=not self._running.is_set(),
            idle_s=self._idle_s,
            failed_requests=self._failed,
            last_error=self._last_error,
            paused_s=self._paused_s
            + (time.monotonic() - self._paused_since if self._paused_since is not None else 0.0),
            reward_pool_restarts=self.rewards.pool_restarts if hasattr(self, "rewards") else 0,
            reward_last_error=self.rewards.last_error if hasattr(self, "rewards") else "",
            agents=self.agents.stats() if self.agents is not None else None,
            reward_model=self.rewards.model_counts if hasattr(self, "rewards") and self.rewards.uses_model else None,
        )

    async def shutdown(self) -> None:
        """Stop generating and shut vLLM down (its engine process included)."""
        self._stop = True
        self._running.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
        for t in list(self._inflight.values()):
            t.cancel()
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        if self.agents is not None:
            await self.agents.endpoint.stop()
        if self._llm is not None:
            vc.shutdown(self._llm)
            self._llm = None
        if hasattr(self, "rewards"):
            self.rewards.close()
        if hasattr(self, "_ctx"):
            self._ctx.destroy(linger=0)
