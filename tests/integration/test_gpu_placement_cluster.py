"""GPU placement on a real Ray cluster whose GPUs are logical (this machine has none): two nodes of
four GPUs each, made for this module and stopped through the handle that made it. The GPU recipes
(configs/gpu/) dry-run against it, and probe actors placed by the run's own pool code (RunPools,
GeneratorPool, WorkerGroup) report the CUDA_VISIBLE_DEVICES Ray gave them: every engine and learner
rank sees exactly its own GPUs, a TP = 2 engine two on one node, a colocated pair one shared GPU,
and nothing lands on GPU 0 by accident. Real vLLM engines cannot start on logical GPUs; the probes
stand in for them with the same Ray options."""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from pathlib import Path

import pytest
import ray
import yaml

from async_rl import launch
from async_rl.cluster.devices import ray_view, resolve_devices
from async_rl.cluster.placement import plan_placement
from async_rl.cluster.pools import RunPools
from async_rl.cluster.resources import WorkerGroup
from async_rl.config import load_config
from async_rl.generator.pool import GeneratorPool

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "configs" / "gpu").glob("*.yaml"))
GPUS_PER_NODE = 4


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    """Head: 4 GPUs and learner_host 4; a second node: 4 GPUs and generator_host 2 (the two-node
    recipe's resources). Both raylets run here."""
    from ray.cluster_utils import Cluster

    # Ray's auth mode is left as the rest of the suite has it: Ray caches it per process at its first
    # start, so switching RAY_AUTH_MODE here after another module started Ray breaks every later start
    # in this process ("InvalidAuthToken ... RAY_AUTH_MODE is currently 'disabled'").
    # On this node's IP, as ray.init would: Ray turns a 127.0.0.1 address into that IP when it connects.
    common = {"num_cpus": 32, "num_gpus": GPUS_PER_NODE}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**common, "resources": {"learner_host": 4}, "include_dashboard": False},
    )
    try:
        cluster.add_node(**common, resources={"generator_host": 2})
        cluster.wait_for_nodes()
        data = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
        data.write_text('{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}\n')
        yield cluster, data
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def offline(cluster, data: Path, model: str = "tiny-qwen2") -> list[str]:
    """A recipe as the tests run it: no model download (a built-in preset; --dry-run loads no
    weights, but check_inputs wants the folder), its data file present, on the test cluster."""
    return [f"model.path={model}", f"data.train_files=[{data}]", f"data.eval_files=[{data}]",
            f"ray.address={cluster.address}"]


def preset_for(recipe: Path) -> str:
    """The built-in preset a recipe dry-runs with: the tiny vision-language one for a recipe with a
    `vision` section, so the launch's checks of what a VLM refuses (vision_settings.py) run on it. Read
    from the YAML: load_config would want the recipe's own data files."""
    return "tiny-qwen2.5-vl" if "vision" in yaml.safe_load(recipe.read_text()) else "tiny-qwen2"


def dry_run(argv: list[str], capsys) -> tuple[int, str, str]:
    if ray.is_initialized():
        ray.shutdown()  # the dry-run connects (and disconnects) itself
    previous = signal.getsignal(signal.SIGTERM)
    try:
        rc = launch.main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_gpu_recipe_dry_runs_clean(gpu_cluster, recipe, capsys):
    cluster, data = gpu_cluster
    overrides = offline(cluster, data, preset_for(recipe))
    rc, out, err = dry_run([str(recipe), "--dry-run", *overrides], capsys)
    assert rc == 0, err
    plan = out[out.index("placement plan"):]
    assert "generators on cuda, learner on cuda" in plan
    cfg = load_config(recipe, overrides)
    # auto picks the GPU channel: CUDA IPC when colocated, NCCL when engines have GPUs of their own
    want = "cuda_ipc" if cfg.placement == "colocated" else "nccl"
    assert f"weight sync: {want}" in plan
    for role in [f"engine {i}" for i in range(cfg.generators.num_engines)] + [
        f"learner rank {r}" for r in range(cfg.learner.world_size)
    ]:
        line = next(x for x in plan.splitlines() if x.strip().startswith(role + " "))
        assert " node " in line and " bundle " in line and " GPU" in line, line


def test_a_plan_the_cluster_cannot_hold_is_one_line(gpu_cluster, capsys):
    cluster, data = gpu_cluster
    recipe = REPO / "configs" / "gpu" / "8gpu_tp2_megatron.yaml"
    rc, out, err = dry_run([str(recipe), "--dry-run", *offline(cluster, data), "generators.num_engines=4"], capsys)
    assert rc == 2
    assert err == ("error: generators need 8 GPUs (4 engines x tensor_parallel_size 2) and the learner needs 4 GPUs "
                   "(4 ranks x 1 GPU each), the Ray cluster offers 8\n")


class Probe:
    """Stands in for a GeneratorEngine or a LearnerDriver: reports what Ray gave it."""

    def __init__(self, *args) -> None:
        pass

    def start(self, paused: bool) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def where(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")


def place_probes(cluster, data: Path, recipe: str, *overrides: str):
    """The recipe's plan, and (node id, visible GPU ids) of a probe in every engine and rank slot."""
    if not ray.is_initialized():
        # Workers import this checkout and this module (Probe is pickled by reference).
        path = f"{REPO}:{Path(__file__).parent}"
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=False)
    cfg = load_config(REPO / "configs" / "gpu" / recipe, [*offline(cluster, data), *overrides])
    view = ray_view(cluster.address)
    cfg = resolve_devices(cfg, view)
    plan = plan_placement(cfg, view=view)
    pools = RunPools(cfg)
    engines = None
    try:
        learner = WorkerGroup(pools.learner(), lambda r, opts, m: ray.remote(Probe).options(**opts).remote(), lambda a: "")
        engines = GeneratorPool(lambda i: None, None, cfg.generators.cpus_per_engine, cfg.generators.tensor_parallel_size,
                                10.0, **pools.generator_pool_kwargs(), actor_cls=Probe)
        engines.add(cfg.generators.num_engines, paused=True)
        seen_ranks = ray.get([a.where.remote() for a in learner.actors])
        seen_engines = ray.get([a.where.remote() for a in engines.actors])
    finally:
        if engines is not None:
            engines.shutdown()
        pools.remove()
    node_name = {n.node_id: n.name for n in view.nodes}

    def parsed(seen):
        return [(node_name[node], [int(g) for g in cuda.split(",")]) for node, cuda in seen]

    return plan, parsed(seen_engines), parsed(seen_ranks)


def assert_matches_plan(plan, engines, ranks, exact: bool = True) -> None:
    """Ray gave each process as many GPUs as the plan shows; `exact`: where the cluster leaves Ray no
    choice (it is full, or custom resources pin the pools), the same GPU indices, and the processes
    the plan puts on one node share a node. With room to spare Ray may pick another node for a pool
    than the plan's first fit (it spread the four-GPU recipe's engines to the idle node)."""
    planned = [p.gpu for p in [*plan.engines, *plan.learner_ranks]]
    actual = [*engines, *ranks]
    assert [len(g.gpus) for g in planned] == [len(gpus) for _, gpus in actual]
    if not exact:
        return
    assert [sorted(g.gpus) for g in planned] == [sorted(gpus) for _, gpus in actual]
    by_plan, by_ray = defaultdict(set), defaultdict(set)
    for i, (slot, (node, _)) in enumerate(zip(planned, actual, strict=True)):
        by_plan[slot.node].add(i)
        by_ray[node].add(i)
    assert sorted(map(sorted, by_plan.values())) == sorted(map(sorted, by_ray.values()))


def test_tp2_engines_and_megatron_ranks_hold_distinct_gpus(gpu_cluster):
    plan, engines, ranks = place_probes(*gpu_cluster, "8gpu_tp2_megatron.yaml")
    assert [len(g) for _, g in engines] == [2, 2] and [len(g) for _, g in ranks] == [1] * 4
    used = [(node, g) for node, gpus in [*engines, *ranks] for g in gpus]
    assert len(used) == len(set(used)) == 8  # every GPU of the cluster once: nothing doubled up on GPU 0
    assert len({node for node, _ in engines}) == 1 and len({node for node, _ in ranks}) == 1
    assert_matches_plan(plan, engines, ranks)


def test_async_engines_and_ranks_one_gpu_each(gpu_cluster):
    plan, engines, ranks = place_probes(*gpu_cluster, "4gpu_async.yaml")
    used = [(node, g) for node, gpus in [*engines, *ranks] for g in gpus]
    assert [len(g) for _, g in [*engines, *ranks]] == [1, 1, 1, 1] and len(set(used)) == 4
    assert_matches_plan(plan, engines, ranks, exact=False)


def test_colocated_pairs_share_one_gpu(gpu_cluster):
    plan, engines, ranks = place_probes(
        *gpu_cluster, "1gpu_colocated.yaml", "generators.num_engines=3", "learner.world_size=3",
        "train.prompts_per_step=63",
    )
    assert engines == ranks  # engine i and learner rank i: the same node, the same single GPU
    assert all(len(g) == 1 for _, g in engines)
    assert len({(node, g[0]) for node, g in engines}) == 3  # three pairs, three GPUs
    assert_matches_plan(plan, engines, ranks, exact=False)


def test_two_node_recipe_puts_learner_and_engines_on_their_hosts(gpu_cluster):
    cluster, data = gpu_cluster
    plan, engines, ranks = place_probes(cluster, data, "2node_tp2_megatron.yaml")
    # The head is the node started with learner_host (ray.nodes() lists nodes in no set order).
    nodes = ray_view(cluster.address).nodes
    heads = {n.name for n in nodes if n.resources.get("learner_host")}
    assert len(heads) == 1 and len(nodes) == 2
    assert {node for node, _ in ranks} == heads
    assert {node for node, _ in engines} == {n.name for n in nodes} - heads
    assert sorted(g for _, gpus in engines for g in gpus) == [0, 1, 2, 3]
    assert_matches_plan(plan, engines, ranks)
