"""The rollout side of MoE, without engines: the MoE presets' routing read from config.json (and known to the
launcher before they are built), the launcher's checks that depend on it, the capture setting's one-line refusals, the fused experts split into vLLM's per-expert checkpoint names,
and a buffer snapshot that keeps every sample's routes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from async_rl.config import load_config
from async_rl.control.settings import route_capture
from async_rl.errors import ConfigError
from async_rl.models import upcycle
from async_rl.models.moe import read_routing
from async_rl.models.tiny import model_routing, resolve_model_path
from async_rl.protocol import RouteLayout
from async_rl.weight_sync.expert_names import per_expert


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("models"))
    return {n: resolve_model_path(n, cache) for n in ("tiny-qwen2", "tiny-qwen3-moe", "tiny-qwen2-moe")}


def test_moe_presets_route_two_of_eight_experts_in_both_layers(presets):
    assert read_routing(presets["tiny-qwen2"]) is None
    for name in ("tiny-qwen3-moe", "tiny-qwen2-moe"):
        r = read_routing(presets[name])
        assert (r.num_experts, r.top_k, r.moe_layers) == (8, 2, [0, 1])
        assert r.layout() == RouteLayout(layers=2, top_k=2, itemsize=1)


def test_the_launcher_knows_a_presets_routing_before_building_it_as_its_folder_states_it(presets, tmp_path):
    for name, folder in presets.items():  # from the code that builds it, as the built folder's config.json says
        assert model_routing(name, str(tmp_path / "unbuilt")) == read_routing(folder)
        assert model_routing(str(folder), str(tmp_path / "unbuilt")) == read_routing(folder)
    assert upcycle.routing().layout() == RouteLayout(layers=30, top_k=2, itemsize=1)
    assert not (tmp_path / "unbuilt").exists()  # nothing built


# 8 samples of 40,960 tokens: 3 MiB without routes; 2 MoE layers x top-2 x 1 byte more a token: 4 MiB
LONG = ["generators.max_model_len=40960", "generators.max_tokens=32768", "generators.group_size=8"]


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "folder"])
def test_the_launcher_refuses_a_frame_limit_too_small_for_the_routes_before_anything_starts(
    model, moe_model_dir, tmp_path, monkeypatch, capsys
):
    from async_rl import launch

    def planning(*_):  # the step after the input check: planning against the (Ray) cluster
        raise ConfigError("past the input check")

    monkeypatch.setattr(launch, "cluster_view", planning)
    path = str(moe_model_dir) if model == "folder" else model
    (tmp_path / "run.yaml").write_text("{}\n")
    args = [str(tmp_path / "run.yaml"), f"model.path={path}", f"model.cache_dir={tmp_path / 'models'}", *LONG]
    assert launch.main([*args, "buffer.max_frame_mb=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: buffer.max_frame_mb=3 is below one group of 8 samples") and err.count("\n") == 1
    assert "with their routes (2 MoE layers x top-2) (4 MiB)" in err
    assert not (tmp_path / "models").exists()  # the preset is not built for the check
    for enough in (["buffer.max_frame_mb=4"], ["buffer.max_frame_mb=3", "generators.capture_routes=off"]):
        assert launch.main([*args, *enough]) == 2 and capsys.readouterr().err == "error: past the input check\n"


def test_the_launcher_checks_an_moe_presets_learner_settings(tmp_path):
    from async_rl.launch import check_inputs

    cache = f"model.cache_dir={tmp_path}"
    with pytest.raises(ConfigError, match=r"^learner.lora: not with an MoE model \(8 experts per MoE layer\)"):
        check_inputs(load_config(None, ["model.path=tiny-qwen2-moe", cache, "learner.lora.enabled=true"]))
    with pytest.raises(ConfigError, match=r"^learner.routing_replay=on: the model is dense"):
        check_inputs(load_config(None, ["model.path=tiny-qwen2", cache, "learner.routing_replay=on"]))
    check_inputs(load_config(None, ["model.path=tiny-qwen3-moe", cache, "learner.routing_replay=on"]))


def test_sparse_step_and_dense_layers_leave_no_column(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_experts": 300, "num_experts_per_tok": 4, "num_hidden_layers": 6, "decoder_sparse_step": 2, '
        '"mlp_only_layers": [3]}'
    )
    r = read_routing(tmp_path)
    assert r.moe_layers == [1, 5] and r.layout().itemsize == 2  # 300 experts: uint16


def test_capture_setting_resolves_and_refuses_in_one_line(presets):
    moe, dense = read_routing(presets["tiny-qwen3-moe"]), read_routing(presets["tiny-qwen2"])
    assert route_capture("auto", dense, False, "cpu") is None
    assert route_capture("off", moe, False, "cpu") is None
    assert route_capture("auto", moe, False, "cpu").moe_layers == [0, 1]
    assert route_capture("auto", moe, True, "cuda").top_k == 2
    for args, says in [
        (("on", dense, False, "cpu"), "not a mixture of experts"),
        (("auto", moe, False, "cuda"), "prefix_caching=on"),
        (("on", moe, True, "cpu"), "prefix_caching=off"),
    ]:
        with pytest.raises(ConfigError, match=says) as info:
            route_capture(*args)
        assert "\n" not in str(info.value)


def test_fused_experts_split_into_per_expert_checkpoint_names():
    fused = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)  # E=2, 2I=6, H=3
    down = torch.arange(2 * 3 * 3, dtype=torch.float32).reshape(2, 3, 3)
    named = dict(per_expert([("model.layers.0.mlp.experts.gate_up_proj", fused),
                             ("model.layers.0.mlp.experts.down_proj", down),
                             ("model.layers.0.mlp.gate.weight", torch.zeros(2, 3))], "qwen3_moe"))
    assert torch.equal(named["model.layers.0.mlp.experts.1.gate_proj.weight"], fused[1, :3])
    assert torch.equal(named["model.layers.0.mlp.experts.1.up_proj.weight"], fused[1, 3:])
    assert torch.equal(named["model.layers.0.mlp.experts.0.down_proj.weight"], down[0])
    assert "model.layers.0.mlp.gate.weight" in named
    mixtral = dict(per_expert([("model.layers.2.mlp.experts.gate_up_proj", fused),
                               ("model.layers.2.mlp.gate.weight", torch.zeros(2, 3))], "mixtral"))
    assert set(mixtral) == {
        *(f"model.layers.2.block_sparse_moe.experts.{e}.{w}.weight" for e in (0, 1) for w in ("w1", "w3")),
        "model.layers.2.block_sparse_moe.gate.weight",
    }


def test_split_names_are_what_hf_writes_to_disk(presets):
    """The split names and values are exactly the checkpoint HF's save_pretrained wrote (what vLLM loads)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = presets["tiny-qwen3-moe"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    split = dict(per_expert(model.state_dict().items(), "qwen3_moe"))
    disk = load_file(str(folder / "model.safetensors"))
    assert {k for k in split if ".experts." in k} == {k for k in disk if ".experts." in k}
    assert all(torch.equal(split[k], disk[k]) for k in disk if ".experts." in k)


def test_buffer_snapshot_keeps_routes(tmp_path):
    from tests.unit.test_elastic_units import deliver, group, make_buffer
    from tests.unit.test_protocol_routes import routes_for

    def routed(pid: int):
        g = group(pid, 0)
        g.routes = [routes_for(len(g.prompt_tokens), len(c), 8, pid * 10 + i, missing_rows=(0,)) for i, c in
                    enumerate(g.completions)]
        return g

    async def scenario():
        buf = make_buffer(tmp_path)
        await buf.lease(engine_id=0, max_groups=3, wait_s=0)
        for pid in (0, 1, 2):
            deliver(buf, routed(pid))
        await buf.server.build(step=0, world_size=1)  # groups 0, 1 built into a batch; 2 waits
        buf.save_snapshot()

    asyncio.run(scenario())
    new = make_buffer(tmp_path, restore=True)
    kept = [*new.server.built()[0][0], *new.server.waiting()]
    assert [g.prompt_id for g in kept] == [0, 1, 2]
    for g in kept:
        want = routed(g.prompt_id).routes
        assert g.routes is not None and len(g.routes) == len(want)
        for a, b in zip(g.routes, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_episode_routes_take_each_row_from_the_first_turn_that_ran_it():
    from async_rl.serving.engine_routes import sequence_routes as episode_routes

    tokens = list(range(10))  # prompt 0-3, model turn 4-6, environment 7, model turn 8-9
    one = np.full((6, 2, 2), 1, np.uint8)  # turn 1: ids 0-3, 3 tokens -> rows 0-5
    two = np.full((9, 2, 2), 2, np.uint8)  # turn 2: ids 0-7, 2 tokens -> rows 0-8 (the prefix again)
    stray = np.full((9, 2, 2), 3, np.uint8)  # input not a prefix of the episode: ignored
    r = episode_routes(tokens, [(tokens[:4], one), ([9, 9, 9, 9, 9, 9, 9, 9], stray), (tokens[:8], two)])
    assert r.shape == (9, 2, 2)
    assert (r[:6] == 1).all() and (r[6:] == 2).all()
    lone = episode_routes(tokens, [(tokens[:4], one)])  # the rows no turn ran stay missing
    assert (lone[6:] == 255).all() and (lone[:6] == 1).all()
    assert episode_routes(tokens, []) is None


def test_buffer_rejects_routes_of_another_layer_count_with_a_counted_reason(tmp_path):
    import msgspec

    from async_rl.buffer.actor import ReplayBuffer
    from async_rl.protocol import encode_groups
    from tests.unit.test_elastic_units import group, make_buffer
    from tests.unit.test_protocol_routes import routes_for

    settings = msgspec.structs.replace(make_buffer(tmp_path).s, routes=RouteLayout(layers=2, top_k=2, itemsize=1))
    buf = ReplayBuffer(settings)

    async def scenario():
        await buf.lease(engine_id=0, max_groups=1, wait_s=0)
        g = group(0, 0)
        g.routes = [routes_for(len(g.prompt_tokens), len(c), 8, i) for i, c in enumerate(g.completions)]  # 3 layers
        buf.ingest.ingest_frame(encode_groups(settings.run_id, [g]))
        return buf.stats()

    stats = asyncio.run(scenario())
    assert stats.rejected_frames == {"bad_routes": 1}
    assert stats.accounts.lost == 2 and stats.accounts.balanced()  # the lease's samples: lost, counted


def test_agent_segments_carry_their_calls_routes():
    from async_rl.agents.episodes import segment_routes
    from async_rl.endpoint.episode_log import CallRecord, Choice, Segment, build_segments

    def call(prompt: list[int], out: list[int], value: int) -> CallRecord:
        rows = np.full((len(prompt) + len(out) - 1, 2, 2), value, np.uint8)
        rows[..., 1] = value + 1  # two distinct experts per layer
        choice = Choice(token_ids=out, logprobs=[-0.1] * len(out), text="", finish_reason="stop",
                        version_first=0, version_last=0, routes=rows)
        return CallRecord(prompt_ids=prompt, choices=[choice])

    calls = [call([1, 2, 3], [4, 5], 10), call([1, 2, 3, 4, 5, 6], [7], 20), call([9, 9], [8], 30)]  # then a break
    segments = build_segments(calls)
    assert len(segments) == 2
    first, second = segment_routes(segments)
    assert first.shape == (6, 2, 2) and (first[:4, :, 0] == 10).all() and (first[4:, :, 0] == 20).all()
    assert second.shape == (2, 2, 2) and (second[..., 0] == 30).all()
    empty = Segment(prompt_ids=[1, 2, 3])  # an agent that failed before its first call
    _, none = segment_routes([segments[0], empty])
    assert none.shape == (2, 2, 2) and (none == 255).all()
    assert segment_routes([empty]) is None
