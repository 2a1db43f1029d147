"""Data-plane security without sockets: per-run keys, who gets which key, frame limits, config."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import zmq

from async_rl import security
from async_rl.cluster.placement import plan_placement
from async_rl.config import describe, load_config
from async_rl.control import settings
from async_rl.errors import ConfigError, RunError
from async_rl.protocol import TrajectoryGroup, decode_groups, encode_groups
from async_rl.security import AllowedKeys, frame_limit_bytes, make_run_keys


def test_run_keys_are_fresh_per_run_and_separate_per_role():
    a, b = make_run_keys(), make_run_keys()
    assert a.server.public != b.server.public and a.engine.secret != b.engine.secret
    for client in (a.engine, a.learner):
        assert client.server_public == a.server.public
        assert len(client.public) == len(client.secret) == 40  # z85 of 32 bytes
        assert zmq.curve_public(client.secret) == client.public
    assert zmq.curve_public(a.server.secret) == a.server.public
    # The ingest socket admits engines only, the serve socket learner ranks only.
    assert a.server.ingest_clients == [a.engine.public]
    assert a.server.serve_clients == [a.learner.public]
    assert a.engine.public != a.learner.public


def test_secret_keys_never_appear_in_a_repr():
    keys = make_run_keys()
    cfg = load_config(None)
    plan = plan_placement(cfg, cores=[0, 1])
    texts = [
        repr(keys),
        repr(settings.buffer_settings(cfg, "r", keys, Path("m"))),
        repr(settings.engine_settings(cfg, "r", Path("/m"), plan, 0, "tcp://127.0.0.1:1", keys)),
        repr(settings.learner_spec(cfg, "r", Path("/m"), Path("/m"), "tcp://127.0.0.1:2", keys)),
    ]
    for text in texts:
        for secret in (keys.server.secret, keys.engine.secret, keys.learner.secret):
            assert secret.decode() not in text


def test_each_process_gets_only_its_own_keys():
    keys = make_run_keys()
    cfg = load_config(None)
    plan = plan_placement(cfg, cores=[0, 1])
    assert settings.buffer_settings(cfg, "r", keys, Path("m")).curve == keys.server
    assert settings.engine_settings(cfg, "r", Path("/m"), plan, 0, "tcp://x:1", keys).curve == keys.engine
    assert settings.learner_spec(cfg, "r", Path("/m"), Path("/m"), "tcp://x:2", keys).curve == keys.learner
    # CURVE off: nobody gets keys.
    assert settings.buffer_settings(cfg, "r", None, Path("m")).curve is None
    assert settings.engine_settings(cfg, "r", Path("/m"), plan, 0, "tcp://x:1", None).curve is None
    assert settings.learner_spec(cfg, "r", Path("/m"), Path("/m"), "tcp://x:2", None).curve is None


def test_libzmq_without_curve_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(security.zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(RunError) as info:
        make_run_keys()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("security.curve:") and "security.curve=false" in msg


def test_disabling_curve_warns_in_one_line():
    out = io.StringIO()
    security.warn_insecure(out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: security.curve=false")


def test_allowed_keys_admit_exactly_the_listed_keys():
    keys = make_run_keys()
    allowed = AllowedKeys([keys.engine.public])
    assert allowed.callback(security.INGEST_DOMAIN, keys.engine.public)
    assert not allowed.callback(security.INGEST_DOMAIN, keys.learner.public)
    assert not allowed.callback(security.INGEST_DOMAIN, zmq.curve_keypair()[0])


# ---------------------------------------------------------------- frame limit


def test_explicit_frame_limit_is_taken_as_mib():
    assert frame_limit_bytes(3, group_size=8, max_model_len=128) == 3 << 20


@pytest.mark.parametrize(("group_size", "max_model_len"), [(8, 128), (16, 4096), (64, 32768)])
def test_computed_frame_limit_admits_the_largest_group_the_engines_can_make(group_size, max_model_len):
    limit = frame_limit_bytes(0, group_size, max_model_len)
    assert limit % (1 << 20) == 0
    prompt_len = 1
    comp_len = max_model_len - prompt_len
    g = TrajectoryGroup(
        prompt_id=2**62,
        engine_id=2**31,
        prompt_tokens=np.zeros(prompt_len, np.int32),
        completions=[np.zeros(comp_len, np.int32)] * group_size,
        logprobs=[np.full(comp_len, -1.0, np.float32)] * group_size,
        rewards=[-1.2345678e300] * group_size,
        version_first=[2**40] * group_size,
        version_last=[2**40] * group_size,
        reward_status=[2] * group_size,
    )
    frames = encode_groups("run-id-1234", [g])
    decode_groups(frames, "run-id-1234", max_bytes=limit)  # does not raise
    # ...and bounds memory: not much more than that largest frame (a MiB of rounding and header slack).
    assert limit < sum(len(f) for f in frames) + (2 << 20)


def test_computed_frame_limit_for_the_default_config_is_one_mib():
    cfg = load_config(None)
    assert settings.buffer_settings(cfg, "r", None, Path("m")).max_frame_bytes == 1 << 20
    cfg = load_config(None, ["buffer.max_frame_mb=5"])
    assert settings.buffer_settings(cfg, "r", None, Path("m")).max_frame_bytes == 5 << 20


# ---------------------------------------------------------------- config


def test_curve_is_on_by_default_and_documented():
    assert load_config(None).security.curve is True
    assert load_config(None, ["security.curve=false"]).security.curve is False
    rows = {key: desc for key, _, desc in describe()}
    assert "CURVE" in rows["security.curve"]
    assert "127.0.0.1" in rows["buffer.host"]
    assert "0 = computed" in rows["buffer.max_frame_mb"]


@pytest.mark.parametrize("host", ["*", "::", ""])
def test_wildcard_buffer_host_is_refused(host):
    # 0.0.0.0 is accepted (multi-node: bind every IPv4 interface, peers get the node's IP)
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"buffer.host={host!r}" if host else "buffer.host="])
    assert str(info.value).startswith("buffer.host=") and "\n" not in str(info.value)


def test_a_node_ip_is_a_valid_buffer_host():
    assert load_config(None, ["buffer.host=10.0.0.7"]).buffer.host == "10.0.0.7"


def test_a_set_frame_limit_below_one_full_length_group_is_one_line():
    from async_rl.config import load_config
    from async_rl.control.settings import frame_limit
    from async_rl.errors import ConfigError

    long = ["generators.max_model_len=40960", "generators.max_tokens=32768", "generators.group_size=8"]
    assert frame_limit(load_config(None, long), None) == frame_limit_bytes(0, group_size=8, max_model_len=40960)
    assert frame_limit(load_config(None, [*long, "buffer.max_frame_mb=3"]), None) == 3 << 20
    with pytest.raises(ConfigError, match=r"buffer.max_frame_mb=2 .*generators.max_model_len=40960") as info:
        frame_limit(load_config(None, [*long, "buffer.max_frame_mb=2"]), None)
    assert "\n" not in str(info.value)
