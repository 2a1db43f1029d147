"""GeneratorEngine: a Ray async actor that keeps one served model (serving/model.py) full.

Loop: lease prompts from the buffer (admission control decides) -> roll each out with the engine's
rollout (single-turn samples, environment episodes or agent episodes, chosen once at start:
generator/rollout.py), scored -> push the group to the buffer over ZMQ. The controller pauses the
engine for weight updates; requests in flight are kept (pause mode 'keep') and every sample records
the first and last policy version that produced its tokens.
"""

from __future__ import annotations

import asyncio
import os

import msgspec
import zmq
import zmq.asyncio

from async_rl.agents.episodes import AgentCounters
from async_rl.config import EnvConfig, TaskConfig, TeacherConfig
from async_rl.evaluation.scores import EvalBatch, EvalParams
from async_rl.generator.request_seeds import RequestSeeds
from async_rl.generator.rewards import RewardRunner
from async_rl.generator.rollout import Rollout, RolloutCounters
from async_rl.generator.rollout_choice import make_rollout
from async_rl.generator.slots import PromptSlots
from async_rl.learner.base import Probe
from async_rl.protocol import Prompt, TrajectoryGroup, encode_groups
from async_rl.reward_models.calls import RewardModelCounts
from async_rl.reward_models.server import RewardEndpoint
from async_rl.security import ClientKeys, harden_client
from async_rl.serving import cpu_threads
from async_rl.serving import vllm_compat as vc
from async_rl.serving.lora_serving import SERVED_LORA_ID
from async_rl.serving.model import ServedModel
from async_rl.serving.sampling import SamplingSpec, stop_token_ids
from async_rl.teacher.scorer import TeacherScorer
from async_rl.teacher.wire import TeacherCounts
from async_rl.weight_sync.base import UpdateReceipt, WeightGroupInfo
from async_rl.weight_sync.bucketing import Manifest
from async_rl.weight_sync.checksum import ShardChecksum


class EngineSettings(msgspec.Struct, frozen=True):
    engine_id: int
    run_id: str
    spec: vc.EngineSpec
    cores: list[int]
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
    teacher: TeacherConfig = msgspec.field(default_factory=TeacherConfig)  # teacher.model '' = no teacher
    teacher_endpoints: list[RewardEndpoint] = []  # the teacher's replicas (on-policy distillation)
    request_seed: int | None = None  # train.deterministic: generators.seed, every request's own seed from it


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
    agents: AgentCounters | None = None  # env=agent: episodes, calls, prefix breaks, agent failures (= rollout.agents)
    reward_model: RewardModelCounts | None = None  # task.reward=judge:/classifier: its calls by outcome
    rollout: RolloutCounters | None = None  # what the engine's rollout kind counted (None: not started)
    teacher: TeacherCounts | None = None  # teacher.model: its scoring calls (None: no teacher)


class EnginePids(msgspec.Struct, frozen=True):
    """Operating-system processes of one engine (operators and crash tests kill them by pid)."""

    actor: int  # the Ray actor process (owns AsyncLLM, the reward threads, the ZMQ socket)
    engine_core: list[int]  # vLLM's processes under the actor (engine core, workers)


class GeneratorEngine:
    def __init__(self, settings: EngineSettings, buffer) -> None:
        self.s = settings
        self.buffer = buffer
        # vLLM reads the thread settings when its engine process starts: set them before it does.
        if settings.cores:
            cpu_threads.bind_engine_to(settings.cores, settings.spec.tensor_parallel_size)
        else:
            cpu_threads.leave_engine_unbound(settings.threads, settings.spec.tensor_parallel_size)
        self.model = ServedModel(settings.spec, settings.pause_mode)
        self.rollout: Rollout | None = None  # chosen at start
        self.seeds = RequestSeeds(settings.request_seed)
        t = settings.teacher
        # teacher.model: each finished group is scored by a teacher replica before it is pushed
        self.teacher = (
            TeacherScorer(settings.teacher_endpoints, t.timeout_s, t.max_wait_s, first=settings.engine_id)
            if t.model
            else None
        )
        self._stop = False
        self._inflight: dict[str, asyncio.Task] = {}  # every request until it is pushed, lost or cancelled
        # a group waiting for its teacher scores gives its generating slot back (slots.py)
        self._slots = PromptSlots(settings.max_inflight_prompts, t.max_waiting_groups if t.model else 0)
        self._requests = 0  # request ids are e{engine}-r{n}-p{prompt}: unique for the run, also when a
        # restarted buffer leases a prompt id again (engine ids are never reused within a run)
        self._loop_task: asyncio.Task | None = None
        self._groups = 0
        self._samples = 0
        self._tokens = 0
        self._idle_s = 0.0
        self._failed = 0
        self._last_error = ""
        self._draining = False
        self._evals = 0  # evaluation calls served (request ids stay unique)
        # learner.lora: the LoRA id an update is loaded into; the one requests name (lora_serving). Kept
        # apart so a test can deliver into another id (verl #7495's failure) and see the sync refuse it.
        self.adapter_slot = SERVED_LORA_ID

    @property
    def version(self) -> int:
        """The policy version the engine serves."""
        return self.model.version

    async def start(self, paused: bool = False) -> None:
        """Start vLLM; a `paused` engine generates only after its first `resume` (new weights)."""
        self.rewards = RewardRunner(
            self.s.task, self.s.reward_timeout_s, self.s.reward_workers, on_restart=self._reward_pool_restarted
        )
        self.rewards.endpoints = list(self.s.reward_endpoints)
        # Its fork server and workers start here, off the event loop (Ray calls keep being served).
        await asyncio.get_running_loop().run_in_executor(None, self.rewards.start)
        await self.model.start()
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
        self.rollout = make_rollout(self.model, self.s.env, self.rewards, self.s.engine_id, self.sampling, self.s.endpoint_host)
        await self.rollout.start()
        if paused:
            self.model.hold()
        else:
            self.model.open()
        self._loop_task = asyncio.create_task(self._generate_loop())

    async def _generate_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop and not self._draining:
            try:
                await self.model.wait_running()
                free = self._slots.room()
                if free <= 0:
                    await self._slots.wait_for_room()
                    continue
                t0 = loop.time()
                prompts: list[Prompt] = await self.buffer.lease.remote(self.s.engine_id, free, 0.5)
                if not self._inflight and not prompts:
                    self._idle_s += loop.time() - t0
                for p in prompts:
                    self._requests += 1
                    rid = f"e{self.s.engine_id}-r{self._requests}-p{p.prompt_id}"
                    self._slots.start(rid)
                    self._inflight[rid] = asyncio.create_task(self._run_prompt(p, rid))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a failed lease call must not end generation silently
                self._last_error = f"lease: {type(exc).__name__}: {exc}"
                self._failed += 1
                await asyncio.sleep(1.0)

    async def _run_prompt(self, prompt: Prompt, request_id: str) -> None:
        """Lease -> roll out (scored) -> the teacher's scores (teacher.model) -> push, for one prompt."""
        try:
            t0 = asyncio.get_running_loop().time()
            sampling = self.seeds.sampling(self.sampling, prompt.prompt_id)
            group = await self.rollout.group(prompt, request_id, sampling, self.s.group_size)
            if self.teacher is not None:
                self._slots.rolled_out(request_id)  # the engine goes on generating meanwhile
                group = await self.teacher.score(group, asyncio.get_running_loop().time() - t0)
            await self._push_group(group)
        except Exception as exc:  # one bad request must not stop the engine; the buffer counts it lost
            self._failed += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            if self.model.dead():
                return  # vLLM itself died: the controller replaces this engine and requeues its leases
            try:
                await self.buffer.mark_lost.remote(self.s.engine_id, [prompt.prompt_id])
            except Exception as lost_exc:
                self._last_error += f"; mark_lost failed: {lost_exc}"
        finally:
            self._inflight.pop(request_id, None)
            self._slots.finished(request_id)

    async def _push_group(self, group: TrajectoryGroup) -> None:
        await self._push.send_multipart(encode_groups(self.s.run_id, [group]))
        self._groups += 1
        self._samples += group.episode_count  # episodes (a split agent episode's segments count once)
        masks = group.loss_masks or [None] * group.size
        self._tokens += sum(len(c) if m is None else int(m.sum()) for c, m in zip(group.completions, masks, strict=True))

    # ---- evaluation (called by the controller) ---------------------------------------------------

    async def evaluate(self, prompts: list[Prompt], params: EvalParams) -> EvalBatch:
        """Roll out and score `prompts` beside the training requests and return the scores to the
        caller. Nothing is pushed to the buffer and the training counters do not move."""
        await self.model.wait_running()
        version = self.version
        self._evals += 1
        prefix = f"e{self.s.engine_id}-eval{self._evals}"
        seeded = [(p, self.seeds.eval(params, p.prompt_id, version)) for p in prompts]  # train.deterministic
        outcomes = await asyncio.gather(
            # watched: a prompt in flight when the engine core dies fails at once, not never
            *(self.model.watched(self.rollout.evaluate(p, ps, f"{prefix}-p{p.prompt_id}"), "eval") for p, ps in seeded),
            return_exceptions=True,
        )
        results, failed = [], 0
        for out in outcomes:
            if isinstance(out, BaseException):  # counted and reported; the other prompts' scores stand
                failed += 1
                self._last_error = f"eval: {type(out).__name__}: {out}"
                continue
            results.append(out)
        if self.model.dead():  # the prompts without a result failed with the engine, not on their own
            return EvalBatch(self.s.engine_id, version, self.version, results, engine_died=True)
        return EvalBatch(
            engine_id=self.s.engine_id, version=version, version_last=self.version, results=results, failed_prompts=failed
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
        return EnginePids(actor=os.getpid(), engine_core=self.model.engine_core_pids())

    async def watch(self) -> str:
        """Returns (why) once this engine cannot serve: its vLLM engine core died or its reward pool
        is stuck. The supervisor keeps one call pending; it also fails (RayActorError) the moment the
        actor itself dies. Either way death is noticed within a poll here, not at the supervisor's
        next health check."""
        while self._stop or not self.model.started or self.healthy():
            await asyncio.sleep(vc.DEATH_POLL_S)
        return self.model.death_line() if self.model.dead() else "its reward pool makes no progress"

    def healthy(self) -> bool:
        """False once vLLM's engine core died (the actor alone cannot generate any more), or once its
        reward pool can make no progress (a restart failed, or calls waited far past one)."""
        return self.model.started and not self.model.dead() and self.rewards.healthy()

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
        await self.model.pause()

    async def sleep(self) -> None:
        """Colocated placement: pause, and on GPU release vLLM's memory to the learner."""
        await self.model.sleep()

    async def resume(self, version: int) -> None:
        await self.model.resume(version)

    async def join_weight_group(self, info: WeightGroupInfo, first_rank: int, manifest: Manifest) -> None:
        await self.model.join_weight_group(info, first_rank, manifest)

    async def receive_weights(self, version: int) -> list[UpdateReceipt]:
        return await self.model.receive_weights(version, self.adapter_slot)

    async def param_checksums(self) -> list[ShardChecksum]:
        return await self.model.param_checksums()

    async def model_runner(self) -> str:
        """vLLM's model runner this engine's workers run (recorded in RUN_DIR/versions.jsonl)."""
        return await self.model.model_runner()

    async def logprobs(self, probe: Probe) -> list[list[float]]:
        """vLLM's log-probs of the probe's tokens at its positions, with the weights served now (the
        probe's own log-probs are not read)."""
        out: list[list[float]] = []
        for i, (ids, positions) in enumerate(zip(probe.token_ids, probe.positions, strict=True)):
            ours = await self.model.score_tokens(ids, f"e{self.s.engine_id}-probe-v{self.version}-{i}", *probe.images_of(i))
            out.append([ours[p] for p in positions])
        return out

    async def score(self, probe: Probe) -> float:
        """Mean |vLLM - learner| log-prob over the probe's tokens, both at the current version."""
        return probe.mean_abs_diff(await self.logprobs(probe))

    def sampling_spec(self) -> SamplingSpec:
        """What this engine samples with (stop tokens resolved from the model's generation config)."""
        return self.sampling

    def set_reward_endpoints(self, endpoints: list[RewardEndpoint]) -> None:
        """The reward model's replicas changed (a dead one was restarted at a new address): calls from
        now on go to these."""
        self.rewards.endpoints = list(endpoints)

    def set_teacher_endpoints(self, endpoints: list[RewardEndpoint]) -> None:
        """The teacher's replicas changed (a dead one was restarted at a new address): groups waiting
        for a score try these from their next attempt on."""
        if self.teacher is not None:
            self.teacher.endpoints = list(endpoints)

    def stats(self) -> EngineStats:
        rewards = getattr(self, "rewards", None)  # set at start
        rollout = self.rollout.counters() if self.rollout is not None else None
        return EngineStats(
            engine_id=self.s.engine_id,
            version=self.version,
            groups_pushed=self._groups,
            samples_pushed=self._samples,
            tokens_generated=self._tokens,
            inflight=len(self._inflight),
            paused=not self.model.running,
            idle_s=self._idle_s,
            failed_requests=self._failed,
            last_error=self._last_error,
            paused_s=self.model.paused_s,
            reward_pool_restarts=rewards.pool_restarts if rewards is not None else 0,
            reward_last_error=rewards.last_error if rewards is not None else "",
            agents=rollout.agents if rollout is not None else None,
            reward_model=rewards.model_counts if rewards is not None and rewards.uses_model else None,
            rollout=rollout,
            teacher=msgspec.structs.replace(self.teacher.counts) if self.teacher is not None else None,
        )

    async def shutdown(self) -> None:
        """Stop generating and shut vLLM down (its engine process included)."""
        self._stop = True
        self.model.open()  # waiters wake and see the stop
        if self._loop_task is not None:
            self._loop_task.cancel()
        for t in list(self._inflight.values()):
            t.cancel()
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        if self.rollout is not None:
            await self.rollout.close()
        if self.teacher is not None:
            await self.teacher.close()
        self.model.shutdown()
        if hasattr(self, "rewards"):
            self.rewards.close()
        if hasattr(self, "_ctx"):
            self._ctx.destroy(linger=0)
