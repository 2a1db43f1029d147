"""Pure logic of the elastic pool: ledger requeue, buffer hand-back and snapshot/restore,
the autoscale policy, and the operator control files."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import msgspec
import numpy as np
import pytest

from async_rl.buffer.actor import BufferSettings, BufferState, ReplayBuffer
from async_rl.buffer.ledger import Ledger
from async_rl.buffer.snapshot import SNAPSHOT_NAME
from async_rl.config import AutoscaleConfig, load_config
from async_rl.control.autoscale import ScaleSignal, decide
from async_rl.control.operator_requests import ControlInbox, NotRunning, ScaleReply, send_scale
from async_rl.control.supervisor import latest_checkpoint, learner_died
from async_rl.errors import ConfigError
from async_rl.protocol import REWARD_CRASH, REWARD_ERROR, REWARD_TIMEOUT, TrajectoryGroup

# ---- ledger ------------------------------------------------------------------------------------


def test_requeued_lease_keeps_balance_and_frees_admission():
    led = Ledger(max_lag=0, batch_samples=8, group_size=4)
    assert led.lease(2) == 2 and led.capacity_groups() == 0
    led.requeued_lease(4)  # one lease handed back
    a = led.accounts
    assert (a.leased, a.in_flight, a.requeued) == (8, 4, 4)
    assert a.balanced()
    assert led.capacity_groups() == 1  # its place may be leased again
    assert led.lease(1) == 1
    led.arrived(4)
    led.arrived(4)
    led.trained(8)
    assert led.accounts.balanced() and led.accounts.leased == 12 and led.accounts.trained == 8


# ---- the buffer's hand-back and snapshot (a plain ReplayBuffer, no Ray, no sockets) -------------


def make_buffer(tmp_path, restore=False, run_id="r1") -> ReplayBuffer:
    settings = BufferSettings(
        run_id=run_id,
        host="127.0.0.1",
        ingest_port=0,
        serve_port=0,
        max_lag=1,
        prompts_per_step=2,
        group_size=2,
        filter_uniform_groups=False,
        max_frame_bytes=1 << 20,
        task_name="repeat",
        task_seed=0,
        snapshot_path=str(tmp_path / SNAPSHOT_NAME),
        restore=restore,
    )
    return ReplayBuffer(settings)


def group(prompt_id: int, engine_id: int, version: int = 0) -> TrajectoryGroup:
    comp = [np.array([1, 2], dtype=np.int32), np.array([3], dtype=np.int32)]
    return TrajectoryGroup(
        prompt_id=prompt_id,
        engine_id=engine_id,
        prompt_tokens=np.array([5, 6], dtype=np.int32),
        completions=comp,
        logprobs=[np.array([-0.5, -0.25], dtype=np.float32), np.array([-1.0], dtype=np.float32)],
        rewards=[0.0, 1.0],
        version_first=[version, version],
        version_last=[version, version],
        reward_status=[0, 0],
    )


def deliver(buf: ReplayBuffer, g: TrajectoryGroup) -> None:
    buf.ingest.check_group(g, set())
    buf.ingest.accept(g)


def test_requeue_hands_prompts_to_the_next_lease_and_rejects_late_frames(tmp_path):
    async def scenario():
        buf = make_buffer(tmp_path)
        leased = await buf.lease(engine_id=0, max_groups=3, wait_s=0)
        assert [p.prompt_id for p in leased] == [0, 1, 2]
        assert await buf.requeue(0) == 3
        a = buf.ledger.accounts
        assert (a.in_flight, a.requeued, a.lost) == (0, 6, 0) and a.balanced()
        assert await buf.lease(engine_id=0, max_groups=3, wait_s=0) == []  # a closed engine gets nothing
        again = await buf.lease(engine_id=1, max_groups=4, wait_s=0)
        assert [p.prompt_id for p in again][:3] == [0, 1, 2]  # handed-back prompts first, none lost
        # A late frame from the dead engine's lease is refused: no sample trained twice.
        with pytest.raises(Exception, match="leased to engine 1"):
            buf.ingest.check_group(group(0, engine_id=0), set())
        assert buf.ledger.accounts.balanced()

    asyncio.run(scenario())


def test_close_engine_stops_leases_but_keeps_its_requests(tmp_path):
    async def scenario():
        buf = make_buffer(tmp_path)
        await buf.lease(engine_id=3, max_groups=1, wait_s=0)
        await buf.close_engine(3)
        assert await buf.lease(engine_id=3, max_groups=1, wait_s=0) == []
        deliver(buf, group(0, engine_id=3))  # its request in flight still finishes and counts
        assert buf.ledger.accounts.waiting == 2 and buf.outstanding(3) == 0

    asyncio.run(scenario())


def test_restore_from_snapshot_redoes_nothing_twice_and_loses_nothing(tmp_path):
    async def scenario():
        buf = make_buffer(tmp_path)
        await buf.lease(engine_id=0, max_groups=4, wait_s=0)  # prompts 0..3
        for pid in (0, 1, 2):
            deliver(buf, group(pid, 0))
        shards = await buf.server.build(step=0, world_size=1)  # trains groups 0, 1
        assert [g.prompt_id for g in shards[0]] == [0, 1]
        buf.save_snapshot()
        # After the snapshot, more happens, then the buffer dies.
        await buf.lease(engine_id=0, max_groups=2, wait_s=0)
        return buf

    asyncio.run(scenario())
    new = make_buffer(tmp_path, restore=True)
    a = new.ledger.accounts
    assert a.balanced() and a.trained == 0  # built, maybe fetched, never acknowledged: not trained
    assert [g.prompt_id for g in new.server.waiting()] == [2]  # the batch's groups 0, 1 are not waiting again
    assert list(new.server.built()) == [0]  # a batch built but not acknowledged is kept (served again)
    # The controller repeats its acknowledgement to a restarted buffer; a second one changes nothing.
    assert asyncio.run(new.ack_batch(0)) == 4 and asyncio.run(new.ack_batch(0)) == 0
    assert a.balanced() and a.trained == 4 and not new.server.built()
    # Prompt 3 was in flight at snapshot time: handed back; the stream continues after it.
    assert a.requeued == 2 and a.in_flight == 0

    new.ledger.generator_version = 2  # the controller tells a restarted buffer the current version

    async def lease_next():
        return [p.prompt_id for p in await new.lease(engine_id=5, max_groups=3, wait_s=0)]

    assert asyncio.run(lease_next()) == [3, 4, 5]


def test_snapshot_of_another_run_is_refused(tmp_path):
    asyncio.run(_snap(make_buffer(tmp_path)))
    with pytest.raises(ValueError, match="not this run"):
        make_buffer(tmp_path, restore=True, run_id="other")


async def _snap(buf):
    buf.save_snapshot()


def test_restore_without_snapshot_is_a_fresh_buffer(tmp_path):
    buf = make_buffer(tmp_path, restore=True)
    assert buf.ledger.accounts.leased == 0


# ---- autoscale policy --------------------------------------------------------------------------

POLICY = AutoscaleConfig(enabled=True, min_engines=1, max_engines=3, window_steps=2, cooldown_steps=2)


def sig(wait: float, fill_groups: int, step_s: float = 1.0) -> ScaleSignal:
    return ScaleSignal(step_s=step_s, learner_wait_s=wait * step_s, waiting_groups=fill_groups, prompts_per_step=4)


def test_grows_when_the_learner_is_starved():
    d = decide(POLICY, [sig(0.8, 0), sig(0.6, 0)], engines=1, steps_since_change=5)
    assert d.engines == 2 and d.reason.startswith("grow 1->2: learner starved")
    assert "learner wait 70%" in d.reason


def test_shrinks_when_generators_idle_on_admission():
    d = decide(POLICY, [sig(0.0, 8), sig(0.01, 6)], engines=3, steps_since_change=5)
    assert d.engines == 2 and "idle on admission" in d.reason and "1.75 batches" in d.reason


def test_holds_when_balanced_measuring_or_cooling_down():
    assert decide(POLICY, [sig(0.1, 2), sig(0.1, 2)], 2, 5).engines == 2
    d = decide(POLICY, [sig(0.9, 0)], 2, 5)
    assert d.engines == 2 and "measuring" in d.reason
    d = decide(POLICY, [sig(0.9, 0), sig(0.9, 0)], 2, 1)
    assert d.engines == 2 and "cooldown" in d.reason


def test_stays_within_bounds():
    assert decide(POLICY, [sig(0.9, 0)] * 2, 3, 5).engines == 3  # starved at max: hold
    assert "at autoscale.max_engines" in decide(POLICY, [sig(0.9, 0)] * 2, 3, 5).reason
    assert decide(POLICY, [sig(0.0, 9)] * 2, 1, 5).engines == 1  # idle at min: hold
    assert decide(POLICY, [], 5, 0).engines == 3  # above max (operator), brought back
    assert decide(POLICY, [], 0, 0).engines == 1


def test_uses_only_the_recent_window():
    old_starved = [sig(1.0, 0)] * 5
    assert decide(POLICY, old_starved + [sig(0.1, 2), sig(0.1, 2)], 2, 9).engines == 2


def test_autoscale_config_rules():
    with pytest.raises(ConfigError, match="min_engines=3 is above max_engines=2"):
        load_config(None, ["generators.autoscale.min_engines=3", "generators.autoscale.max_engines=2"])
    with pytest.raises(ConfigError, match="shrink_wait_frac"):
        load_config(None, ["generators.autoscale.shrink_wait_frac=0.5", "generators.autoscale.grow_wait_frac=0.4"])
    assert load_config(None, []).generators.autoscale.enabled is False  # off by default


# ---- control files ------------------------------------------------------------------------------


def test_scale_request_round_trip(tmp_path):
    inbox = ControlInbox(tmp_path, "run1")
    answered = []

    def controller():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for req in inbox.poll():
                inbox.answer(ScaleReply(req.request_id, True, 1, req.engines, "applied"))
                answered.append(req.engines)
                return
            time.sleep(0.05)

    t = threading.Thread(target=controller)
    t.start()
    reply = send_scale(tmp_path, 3, timeout_s=10, poll_s=0.05)
    t.join()
    assert answered == [3] and reply.ok and reply.engines_after == 3
    assert not list((tmp_path / "control" / "requests").iterdir())  # consumed


def test_scale_of_a_run_not_running(tmp_path):
    with pytest.raises(NotRunning, match="does not exist"):
        send_scale(tmp_path / "nope", 2, timeout_s=1)
    with pytest.raises(NotRunning, match="is not running"):
        send_scale(tmp_path, 2, timeout_s=1)
    inbox = ControlInbox(tmp_path, "run1")
    inbox.close()  # a finished run removes its endpoint
    with pytest.raises(NotRunning, match="is not running"):
        send_scale(tmp_path, 2, timeout_s=1)


def test_scale_times_out_and_withdraws_its_request(tmp_path):
    ControlInbox(tmp_path, "run1")  # running, but never answers
    with pytest.raises(TimeoutError, match="no reply"):
        send_scale(tmp_path, 2, timeout_s=0.3, poll_s=0.05)
    assert not list((tmp_path / "control" / "requests").glob("*.json"))


def test_malformed_request_is_answered_not_fatal(tmp_path):
    inbox = ControlInbox(tmp_path, "run1")
    (inbox.requests / "bad.json").write_bytes(b'{"engines": "many"}')
    items = inbox.poll()
    assert len(items) == 1 and isinstance(items[0], ScaleReply) and not items[0].ok
    reply = msgspec.json.decode((inbox.replies / "bad.json").read_bytes(), type=ScaleReply)
    assert "not a valid ScaleRequest" in reply.message


def test_scale_cli_rejects_k_below_one(tmp_path, capsys):
    from async_rl.control.scale import main

    assert main([str(tmp_path), "--engines", "0"]) == 2
    assert "--engines must be at least 1" in capsys.readouterr().err
    assert main([str(tmp_path), "--engines", "2", "--timeout", "1"]) == 1
    assert "is not running" in capsys.readouterr().err


# ---- learner death message ---------------------------------------------------------------------


def test_learner_death_is_one_line_and_the_newest_complete_checkpoint_is_found(tmp_path):
    assert learner_died(1, RuntimeError("actor died\nmore")) == "learner rank 1 died (actor died)"
    assert latest_checkpoint(tmp_path) is None
    for step in (4, 8):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "run_state.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_12").mkdir()  # being written (no run state yet): not resumable
    assert latest_checkpoint(tmp_path).endswith("step_8")


# ---- multi-node addresses ----------------------------------------------------------------------


def test_all_interfaces_are_advertised_as_the_node_ip():
    import ipaddress

    from async_rl.cluster.net import advertised_host

    assert advertised_host("127.0.0.1") == "127.0.0.1"  # loopback stays loopback (one machine)
    ip = ipaddress.ip_address(advertised_host("0.0.0.0"))  # peers cannot connect to 0.0.0.0
    assert not ip.is_unspecified


def test_checkpoint_restore_leases_handed_back_and_in_flight_prompts_first(tmp_path):
    """A resumed run generates again the prompts that were handed back or in flight at checkpoint
    time (counted requeued, none skipped) and trains the groups that were waiting (none lost)."""

    async def scenario():
        old = make_buffer(tmp_path)
        await old.lease(engine_id=0, max_groups=2, wait_s=0)  # prompts 0, 1 to engine 0
        await old.lease(engine_id=1, max_groups=2, wait_s=0)  # prompts 2, 3 to engine 1
        assert await old.requeue(0, [1]) == 1  # prompt 1 handed back, not yet leased again
        deliver(old, group(2, engine_id=1))  # prompt 2's group is waiting
        state = old.checkpoint_state()
        assert sorted(p.prompt_id for p in state.returned) == [0, 1, 3]
        new = make_buffer(tmp_path / "resumed")
        await new.restore(msgspec.json.decode(msgspec.json.encode(state), type=BufferState))
        a = new.ledger.accounts
        assert a.balanced() and (a.in_flight, a.waiting, a.lost) == (0, 2, 0)  # prompt 2's group kept
        assert a.requeued == 2 + 4  # prompt 1 before the checkpoint, prompts 0 and 3 at restore
        leased = [p.prompt_id for p in await new.lease(engine_id=7, max_groups=4, wait_s=0)]
        assert sorted(leased) == [0, 1, 3]  # admission counts the kept group: 3 of the 4 groups' room
        deliver(new, group(0, engine_id=7))
        shards = await new.server.build(step=0, world_size=1)
        assert [g.prompt_id for g in shards[0]] == [2, 0]  # the kept group is trained first
        assert new.server.ack(0) == 4 and new.ledger.accounts.lost == 0

    (tmp_path / "resumed").mkdir()
    asyncio.run(scenario())


def test_groups_built_or_waiting_at_checkpoint_time_survive_the_checkpoint_files(tmp_path):
    """A batch built ahead and a waiting group go through checkpoint.commit/load_state (their frames
    beside run_state.json) and come back waiting, in the order they were to be trained."""
    from async_rl.control import checkpoint

    async def scenario():
        old = make_buffer(tmp_path)
        await old.lease(engine_id=0, max_groups=3, wait_s=0)
        for pid in (0, 1, 2):
            deliver(old, group(pid, engine_id=0))
        await old.server.build(step=0, world_size=1)  # groups 0, 1: built, not yet trained
        tmp = checkpoint.begin(tmp_path / "run")
        state = checkpoint.RunCheckpoint(step=0, version=0, buffer=old.checkpoint_state(), saved_at=0.0)
        final = checkpoint.commit(tmp, state, keep=2)
        assert b"buffer_groups" not in (final / checkpoint.RUN_STATE).read_bytes()
        assert len(msgspec.json.decode((final / checkpoint.RUN_STATE).read_bytes())["buffer"]["groups"]) == 0
        new = make_buffer(tmp_path / "resumed")
        await new.restore(checkpoint.load_state(final).buffer)
        assert [g.prompt_id for g in new.server.waiting()] == [0, 1, 2]
        a = new.ledger.accounts
        assert a.balanced() and (a.waiting, a.lost) == (6, 0)

    (tmp_path / "resumed").mkdir()
    asyncio.run(scenario())


def test_replayed_steps_are_kept_by_a_checkpoint(tmp_path):
    """Steps a recovered learner trained again stay admitted in a run resumed from a later checkpoint."""

    async def scenario():
        old = make_buffer(tmp_path)
        await old.set_replayed_steps(3)
        state = msgspec.json.decode(msgspec.json.encode(old.checkpoint_state()), type=BufferState)
        new = make_buffer(tmp_path / "resumed")
        await new.restore(state)
        assert new.ledger.replayed_steps == 3

    (tmp_path / "resumed").mkdir()
    asyncio.run(scenario())


def test_reward_outcomes_counted_per_reason_and_kept_by_the_snapshot(tmp_path):
    async def scenario():
        buf = make_buffer(tmp_path)
        await buf.lease(engine_id=0, max_groups=2, wait_s=0)
        for pid, statuses in ((0, [REWARD_CRASH, REWARD_TIMEOUT]), (1, [REWARD_ERROR, REWARD_CRASH])):
            deliver(buf, dataclasses.replace(group(pid, 0), reward_status=statuses))
        stats = buf.stats()
        assert (stats.reward_errors, stats.reward_timeouts, stats.reward_crashes) == (1, 1, 2)
        assert buf.checkpoint_state().reward_crashes == 2
        buf.save_snapshot()

    asyncio.run(scenario())
    stats = make_buffer(tmp_path, restore=True).stats()
    assert (stats.reward_errors, stats.reward_timeouts, stats.reward_crashes) == (1, 1, 2)


def test_batch_fetched_by_a_learner_that_died_is_lost_never_trained(tmp_path):
    async def scenario():
        buf = make_buffer(tmp_path)
        await buf.lease(engine_id=0, max_groups=3, wait_s=0)
        for pid in (0, 1, 2):
            deliver(buf, group(pid, 0))
        await buf.server.build(step=0, world_size=1)  # fetched by the learner, which then died
        return await buf.close()

    final = asyncio.run(scenario())
    a = final.accounts
    assert a.balanced() and a.trained == 0 and a.lost == 4 and a.waiting == 2
