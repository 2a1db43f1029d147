"""The placement plan: which process gets which CPU cores and which GPUs. Pure logic, printed by --dry-run.

Cores: generator engines take cores from the front, learner ranks follow; on a machine with fewer
cores than asked for, assignments wrap around and the plan says it is oversubscribed. The buffer and
the controller are light (I/O and control) and are not pinned.

On a Ray cluster (`ray.address` set) no core is pinned: Ray places each process on whichever node
has room, and this machine's core ids mean nothing there. Each process then runs as many threads as
Ray gave it CPUs (Ray sets OMP_NUM_THREADS).

GPUs: every process asks Ray for the GPUs it uses, through the bundles made here (the run's resource
pools use the same functions): an engine on cuda holds `tensor_parallel_size` GPUs in one bundle (one
node), a learner rank on cuda one GPU. `placement: colocated` on cuda makes one shared pool of
one-GPU bundles; engine i and learner rank i both run in bundle i, each asking Ray for
COLOCATED_GPU_SHARE of its GPU. Ray then sets each process's CUDA_VISIBLE_DEVICES to exactly its
GPUs. The plan simulates Ray's placement in the order the run creates its pools (the learner's
first, then one per engine; first fit) to show node, bundle and GPU index of every process (where
the cluster has room to spare Ray may choose another node), and a plan the cluster cannot hold
fails before anything starts, with one line naming what is missing.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import msgspec

from async_rl.cluster.devices import ClusterView, device_of, local_view
from async_rl.config import Config, RewardModelServing, reward_model_serving
from async_rl.errors import ConfigError

# Ray's GPU fraction for each process of a colocated pair (an engine and a learner rank in one
# one-GPU bundle): Ray only schedules by it; vLLM's gpu_memory_utilization splits the memory.
COLOCATED_GPU_SHARE = 0.5


class GpuSlot(msgspec.Struct, frozen=True):
    node: str
    bundle: str  # 'learner[3]' (pool[bundle index]), 'engine-0[0]', 'colocated[2]'
    gpus: list[int]  # indices on the node, as planned (Ray sets CUDA_VISIBLE_DEVICES at start)
    share: float = 1.0  # of each GPU: COLOCATED_GPU_SHARE when an engine and a learner rank share it


class ProcessPlacement(msgspec.Struct, frozen=True):
    role: str
    cores: list[int]
    gpu: GpuSlot | None = None


class PlacementPlan(msgspec.Struct, frozen=True):
    num_cores: int
    engines: list[ProcessPlacement]
    learner_ranks: list[ProcessPlacement]
    oversubscribed: bool
    colocated: bool = False
    cluster: bool = False  # a Ray cluster: processes are placed by Ray and not pinned
    gpu_summary: str = ""  # '' when no process uses a GPU
    # the replicas served beside the pool (task.reward=judge:/classifier:, teacher.model), as the plan shows them
    reward_models: str = ""

    def _gpu_text(self, p: ProcessPlacement) -> str:
        if p.gpu is None:
            return ""
        g = p.gpu
        ids = ",".join(map(str, g.gpus))
        shared = f" (shared, {g.share:g} each)" if g.share < 1 else ""
        return f"node {g.node}  bundle {g.bundle}  GPU{'s' if len(g.gpus) > 1 else ''} {ids}{shared}"

    def render(self) -> str:
        procs = [*self.engines, *self.learner_ranks]
        gpus = f"; {self.gpu_summary}" if self.gpu_summary else ""
        if self.cluster:
            lines = [f"placement plan (Ray cluster: nothing pinned; Ray places by CPUs, GPUs and ray_resources{gpus}):"]
            lines += [f"  {p.role:<18} {self._gpu_text(p) or 'a node Ray picks'}" for p in procs]
            lines += [f"  {'beside the pool':<18} {self.reward_models}"] if self.reward_models else []
            lines.append(f"  {'buffer':<18} the controller's node (its snapshot is in the run directory)")
            lines.append(f"  {'controller':<18} this process")
            return "\n".join(lines)
        note = ", OVERSUBSCRIBED" if self.oversubscribed else ""
        shared = {c for e in self.engines for c in e.cores} & {c for r in self.learner_ranks for c in r.cores}
        note += ", colocated: generators and learner alternate on the same cores" if self.colocated and shared else ""
        lines = [f"placement plan ({self.num_cores} cores{note}{gpus}):"]
        for p in procs:
            gpu = self._gpu_text(p)
            lines.append(f"  {p.role:<18} cores {','.join(map(str, p.cores))}" + (f"  {gpu}" if gpu else ""))
        lines += [f"  {'beside the pool':<18} {self.reward_models}"] if self.reward_models else []
        lines.append(f"  {'buffer':<18} unpinned (ZMQ I/O)")
        lines.append(f"  {'controller':<18} unpinned (this process)")
        return "\n".join(lines)


# ---- bundles: what each process asks Ray for (the run's pools and the plan use these) -------------


def generators_on_cuda(cfg: Config) -> bool:
    return device_of(cfg.generators.device) == "cuda"


def learner_on_cuda(cfg: Config) -> bool:
    return device_of(cfg.learner.device) == "cuda"


def shares_gpus(cfg: Config) -> bool:
    """Colocated on cuda: one engine and one learner rank per GPU, in a shared one-GPU bundle."""
    return cfg.placement == "colocated" and generators_on_cuda(cfg) and learner_on_cuda(cfg)


def engine_bundle(cfg: Config) -> dict[str, float]:
    g = cfg.generators
    gpus = {"GPU": float(g.tensor_parallel_size)} if generators_on_cuda(cfg) else {}
    return {"CPU": g.cpus_per_engine, **gpus, **g.ray_resources}


def learner_bundle(cfg: Config) -> dict[str, float]:
    gpus = {"GPU": 1.0} if learner_on_cuda(cfg) else {}
    return {"CPU": cfg.learner.cpus_per_rank, **gpus, **cfg.learner.ray_resources}


def colocated_bundles(cfg: Config) -> list[dict[str, float]]:
    """One one-GPU bundle per engine/learner-rank pair (max of the two counts): bundle i holds engine i
    and learner rank i, so each bundle's CPUs and custom resources are those of what it holds."""
    g, learner = cfg.generators, cfg.learner
    out = []
    for i in range(max(g.num_engines, learner.world_size)):
        b: dict[str, float] = {"CPU": 0.0, "GPU": 1.0}
        for holds, cpus, custom in (
            (i < g.num_engines, g.cpus_per_engine, g.ray_resources),
            (i < learner.world_size, learner.cpus_per_rank, learner.ray_resources),
        ):
            if holds:
                b["CPU"] += cpus
                for k, v in custom.items():
                    b[k] = max(b.get(k, 0.0), v)
        out.append(b)
    return out


# ---- GPU plan: Ray's placement simulated on the cluster's nodes ----------------------------------


class _Node:
    def __init__(self, name: str, resources: dict[str, float]) -> None:
        self.name = name
        self.free = dict(resources)
        self.gpu_ids = list(range(int(resources.get("GPU", 0))))

    def fits(self, bundle: dict[str, float]) -> bool:
        return all(self.free.get(k, 0.0) >= v - 1e-9 for k, v in bundle.items() if v > 0)

    def take(self, bundle: dict[str, float]) -> list[int]:
        for k, v in bundle.items():
            self.free[k] = self.free.get(k, 0.0) - v
        n = int(round(bundle.get("GPU", 0)))
        got, self.gpu_ids = self.gpu_ids[:n], self.gpu_ids[n:]
        return got


def _n(count: float, unit: str) -> str:
    return f"{count:g} {unit}{'' if count == 1 else 's'}"


def _fmt(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items() if v) + "}"


class _Demand(msgspec.Struct, frozen=True):
    who: str  # 'generators', 'the learner', 'colocated engine/learner pairs'
    count: int
    unit: str  # 'engine', 'rank', 'GPU'
    bundles: list[dict[str, float]]
    why: dict[str, str]  # resource -> how one process's share is set ('tensor_parallel_size 2')


def _demands(cfg: Config) -> list[_Demand]:
    g, learner = cfg.generators, cfg.learner
    if shares_gpus(cfg):
        bundles = colocated_bundles(cfg)
        return [_Demand("colocated engine/learner pairs", len(bundles), "pair", bundles, {"GPU": "1 GPU each"})]
    eb, lb = engine_bundle(cfg), learner_bundle(cfg)
    ewhy = {"GPU": f"tensor_parallel_size {g.tensor_parallel_size}", "CPU": f"cpus_per_engine {g.cpus_per_engine}"}
    lwhy = {"GPU": "1 GPU each", "CPU": f"cpus_per_rank {learner.cpus_per_rank}"}
    demands = [
        _Demand("the learner", learner.world_size, "rank", [lb] * learner.world_size, lwhy),
        _Demand("generators", g.num_engines, "engine", [eb] * g.num_engines, ewhy),
    ]
    if serving := reward_model_serving(cfg.task):  # the reward model's replicas, beside the pool
        gpus = cfg.task.judge.tensor_parallel_size if serving is cfg.task.judge else 1
        bundle = replica_bundle(serving, gpus)
        why = {"GPU": f"{gpus} per replica", "CPU": f"cpus_per_replica {serving.cpus_per_replica}"}
        demands.append(_Demand("reward model", serving.replicas, "replica", [bundle] * serving.replicas, why))
    if cfg.teacher.model:  # the distillation teacher's replicas, beside the pool
        t = cfg.teacher
        why = {"GPU": f"{t.tensor_parallel_size} per replica", "CPU": f"cpus_per_replica {t.cpus_per_replica}"}
        demands.append(_Demand("teacher", t.replicas, "replica", [replica_bundle(t, t.tensor_parallel_size)] * t.replicas, why))
    return demands


def replica_bundle(serving: RewardModelServing, gpus: int) -> dict[str, float]:
    """One reward-model replica's Ray resources, from its config alone: its CPUs, its GPUs (cuda),
    the custom resources that pick its nodes."""
    device = device_of(serving.device)
    return {"CPU": serving.cpus_per_replica, **({"GPU": float(gpus)} if device == "cuda" else {}), **serving.ray_resources}


def _check_totals(demands: list[_Demand], view: ClusterView) -> None:
    """One line naming the first resource the cluster has too little of in total."""
    keys: list[str] = []
    for d in demands:
        for b in d.bundles:
            keys += [k for k in b if k not in keys]
    order = ["GPU"] + [k for k in keys if k not in ("GPU", "CPU")] + ["CPU"]
    for key in order:
        if key == "CPU" and view.local:
            continue  # a local Ray is started with the CPUs the plan needs
        need = sum(b.get(key, 0.0) for d in demands for b in d.bundles)
        have = view.total(key)
        if need <= have + 1e-9:
            continue
        parts = []
        for d in sorted(demands, key=lambda d: d.who != "generators"):
            n = sum(b.get(key, 0.0) for b in d.bundles)
            if n:
                each = d.why.get(key, f"ray_resources.{key} {d.bundles[0].get(key, 0):g}")
                verb = "needs" if d.who.startswith("the ") else "need"
                amount = _n(n, key) if key in ("GPU", "CPU") else f"{n:g} of resource '{key}'"
                parts.append(f"{d.who} {verb} {amount} ({_n(d.count, d.unit)} x {each})")
        where = "this machine offers" if view.local else "the Ray cluster offers"
        raise ConfigError(f"{' and '.join(parts)}, {where} {have:g}")


def _place(nodes: list[_Node], bundles: list[dict[str, float]]) -> list[tuple[str, list[int]]] | int:
    """One placement group with PACK: every bundle on one node when one node can hold them all,
    else each on the first node with room. Returns (node, GPU ids) per bundle, or the index of the
    first bundle that found no room."""
    whole: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            whole[k] = whole.get(k, 0.0) + v
    for node in nodes:
        if node.fits(whole):
            return [(node.name, node.take(b)) for b in bundles]
    out = []
    for i, b in enumerate(bundles):
        node = next((n for n in nodes if n.fits(b)), None)
        if node is None:
            return i
        out.append((node.name, node.take(b)))
    return out


def _no_room(what: str, bundle: dict[str, float], nodes: list[_Node]) -> ConfigError:
    keys = [k for k in bundle if bundle[k]]
    free = "; ".join(f"{n.name} {_fmt({k: n.free.get(k, 0.0) for k in keys})}" for n in nodes)
    return ConfigError(f"{what} needs {_fmt(bundle)} on one node, and no node has that left (free: {free})")


def plan_gpus(cfg: Config, view: ClusterView) -> tuple[list[GpuSlot | None], list[GpuSlot | None]]:
    """Every engine's and learner rank's node, bundle and GPUs on `view`, in the order the run makes
    its pools; ConfigError (one line) when the cluster cannot hold them."""
    demands = _demands(cfg)
    _check_totals(demands, view)
    g, learner = cfg.generators, cfg.learner
    nodes = [_Node(n.name, n.resources) for n in view.nodes]
    if shares_gpus(cfg):
        bundles = colocated_bundles(cfg)
        placed = _place(nodes, bundles)
        if isinstance(placed, int):
            raise _no_room(f"colocated GPU {placed}", bundles[placed], nodes)
        slots = [GpuSlot(n, f"colocated[{i}]", ids, COLOCATED_GPU_SHARE) for i, (n, ids) in enumerate(placed)]
        return slots[: g.num_engines], slots[: learner.world_size]
    lb = learner_bundle(cfg)
    placed = _place(nodes, [lb] * learner.world_size)
    if isinstance(placed, int):
        raise _no_room(f"learner rank {placed}", lb, nodes)
    ranks = [GpuSlot(n, f"learner[{r}]", ids) for r, (n, ids) in enumerate(placed)]
    eb = engine_bundle(cfg)
    engines = []
    for i in range(g.num_engines):
        one = _place(nodes, [eb])
        if isinstance(one, int):
            raise _no_room(f"engine {i}", eb, nodes)
        engines.append(GpuSlot(one[0][0], f"engine-{i}[0]", one[0][1]))
    gen_gpu, learner_gpu = generators_on_cuda(cfg), learner_on_cuda(cfg)
    return [s if gen_gpu else None for s in engines], [s if learner_gpu else None for s in ranks]


def _gpu_summary(cfg: Config, view: ClusterView) -> str:
    gen = "cuda" if generators_on_cuda(cfg) else "cpu"
    lrn = "cuda" if learner_on_cuda(cfg) else "cpu"
    where = f"{view.source}, {len(view.nodes)} node{'s' if len(view.nodes) > 1 else ''}, {view.total('GPU'):g} GPUs"
    return (f"generators on {gen}, learner on {lrn}; {where}; nodes and GPU indices as planned (Ray may pick "
            "another node with room), each process's CUDA_VISIBLE_DEVICES set by Ray at start")


CORES_ENV = "ASYNC_RL_CORES"


def available_cores() -> list[int]:
    """The cores a run on this machine pins its processes to, in the order the plan hands them out:
    $ASYNC_RL_CORES when set ('1,0', '4-7,0-3': like CUDA_VISIBLE_DEVICES, it is inherited by every
    process the run starts), else every core this process may run on, ascending. Two runs sharing a
    machine's cores (the test suite's parallel workers) give each its own order, so that their first
    engines do not both land on core 0."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = list(range(os.cpu_count() or 1))
    spec = os.environ.get(CORES_ENV, "").strip()
    return parse_cores(spec, allowed) if spec else allowed


def parse_cores(spec: str, allowed: list[int]) -> list[int]:
    """'1,0' or '4-7,0-3' -> [1, 0] or [4, 5, 6, 7, 0, 1, 2, 3]; every core once and in `allowed`."""
    cores: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last if dash else first)
        except ValueError:
            raise ConfigError(f"{CORES_ENV}='{spec}': '{part}' is not a core or a range of cores (like '1,0' or '4-7')") from None
        cores.extend(range(lo, hi + 1))
    outside = [c for c in cores if c not in allowed]
    if not cores or outside or len(set(cores)) != len(cores):
        why = f"cores {outside} are not among this process's {allowed}" if outside else "names a core twice or none"
        raise ConfigError(f"{CORES_ENV}='{spec}' {why}")
    return cores


def plan_placement(cfg: Config, cores: list[int] | None = None, view: ClusterView | None = None) -> PlacementPlan:
    """`view`: the cluster the run will use (launch.py makes it); None: this machine, for a config
    whose processes use no GPU (tests). With a view, a plan the cluster cannot hold raises
    ConfigError naming what is missing."""
    cores = cores if cores is not None else available_cores()
    plan = msgspec.structs.replace(_plan_cores(cfg, cores), reward_models=_reward_model_text(cfg))
    uses_gpus = generators_on_cuda(cfg) or learner_on_cuda(cfg)
    if view is None and not uses_gpus:
        return plan
    view = view if view is not None else local_view()
    engine_gpus, rank_gpus = plan_gpus(cfg, view)
    if not uses_gpus:
        return plan

    def attach(procs: list[ProcessPlacement], slots: list[GpuSlot | None]) -> list[ProcessPlacement]:
        return [msgspec.structs.replace(p, gpu=s) for p, s in zip(procs, slots, strict=True)]

    return msgspec.structs.replace(
        plan,
        engines=attach(plan.engines, engine_gpus),
        learner_ranks=attach(plan.learner_ranks, rank_gpus),
        gpu_summary=_gpu_summary(cfg, view),
    )


def _reward_model_text(cfg: Config) -> str:
    """The replicas served beside the pool (the reward model's, the teacher's), as the plan shows them."""
    parts = []
    if (serving := reward_model_serving(cfg.task)) is not None:
        parts.append((cfg.task.reward.partition(":")[0], serving))
    if cfg.teacher.model:
        parts.append(("teacher", cfg.teacher))
    return "; ".join(f"{kind}: {s.replicas} replica(s) of {s.cpus_per_replica} CPU(s), device {s.device}, unpinned, each "
                     "in a placement group of its own" for kind, s in parts)


def _plan_cores(cfg: Config, cores: list[int]) -> PlacementPlan:
    if cfg.ray.address:
        return PlacementPlan(
            num_cores=len(cores),
            engines=[ProcessPlacement(f"engine {i}", []) for i in range(cfg.generators.num_engines)],
            learner_ranks=[ProcessPlacement(f"learner rank {r}", []) for r in range(cfg.learner.world_size)],
            oversubscribed=False,
            colocated=cfg.placement == "colocated",
            cluster=True,
        )
    next_index = 0

    def take(n: int) -> list[int]:
        nonlocal next_index
        got = [cores[(next_index + i) % len(cores)] for i in range(n)]
        next_index += n
        return got

    g = cfg.generators
    colocated = cfg.placement == "colocated"
    engines = [ProcessPlacement(f"engine {i}", take(g.cpus_per_engine)) for i in range(g.num_engines)]
    if colocated and next_index + cfg.learner.world_size * cfg.learner.cpus_per_rank > len(cores):
        next_index = 0  # too few cores for both: the learner takes the engines' cores; the two sides take turns
    ranks = [
        ProcessPlacement(f"learner rank {r}", take(cfg.learner.cpus_per_rank)) for r in range(cfg.learner.world_size)
    ]
    return PlacementPlan(
        num_cores=len(cores),
        engines=engines,
        learner_ranks=ranks,
        oversubscribed=next_index > len(cores),
        colocated=colocated,
    )


def pin_current_process(cores: list[int]) -> None:
    """Pin this process (and the threads it starts later) to `cores`; size torch's thread pool to match.
    No cores: not pinned, and torch keeps the thread count Ray gave the process."""
    if not cores:
        return
    if hasattr(os, "sched_setaffinity"):
        # sched_setaffinity(0) pins only the calling thread, and a Ray actor's constructor does not run
        # on the main thread: pin every thread the process has, so threads any of them start later
        # (vLLM's engine process, torch's pool, Ray's own) inherit the cores.
        tasks = Path("/proc/self/task")
        for tid in [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [0]:
            with contextlib.suppress(ProcessLookupError):  # a thread may exit meanwhile
                os.sched_setaffinity(tid, set(cores))
    try:
        import torch

        torch.set_num_threads(max(1, len(cores)))
    except ImportError:
        pass
