"""A failure in another process is one line with its root cause: the exception the actor raised (not
Ray's traceback wrapping), how an actor's process died, and for vLLM's engine core (a child process
whose cause is only in the shared log) the cause read back from that log and its exit code in words."""

from __future__ import annotations

import os

import pytest
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError, RayTaskError

from async_rl.control.remote_cause import cause_line
from async_rl.control.start_retry import StartRetry, StartsSpent
from async_rl.serving import core_start
from async_rl.serving.core_start import EngineStartError

VLLM_SUMMARY = "Engine core initialization failed. See root cause above. Failed core proc(s): {}"
CORE_LOG = """\
(EngineCore_DP0 pid=4242) ERROR 12-07 03:10:11 [core.py:1510] EngineCore failed to start.
(EngineCore_DP0 pid=4242) Traceback (most recent call last):
(EngineCore_DP0 pid=4242)   File "vllm/v1/engine/core.py", line 1480, in run_engine_core
(EngineCore_DP0 pid=4242)     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore_DP0 pid=4242) ERROR 12-07 03:10:11 [core.py:1510] ValueError: To serve at least one request with the model's max seq len (256), (0.01 GiB KV cache is needed, which is larger than the available KV cache memory (0.00 GiB).
Traceback (most recent call last):
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def remote(cause: BaseException) -> RayTaskError:
    """What ray.get raises for `cause` raised in an actor's method."""
    return RayTaskError("GeneratorEngine.start", "Traceback ...\n" + repr(cause), cause, proctitle="ray::GeneratorEngine.start()")


def test_the_engine_cores_cause_is_read_back_from_the_log_it_wrote():
    assert core_start.cause_in_log(CORE_LOG).startswith("ValueError: To serve at least one request")
    line = core_start.explain(RuntimeError(VLLM_SUMMARY), CORE_LOG)
    assert line.startswith("vLLM's engine core failed to start: ValueError: To serve at least one request")
    assert "See root cause above" not in line
    assert line.endswith("[async_rl: generators.kv_cache_gib (cpu), generators.gpu_memory_utilization (cuda), "
                         "generators.max_model_len]")  # vLLM names its arguments; the user sets ours


def test_an_engine_core_killed_while_it_starts_is_named_by_its_signal():
    killed = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': -9}")
    assert core_start.explain(killed, "") == (
        "vLLM's engine core failed to start: EngineCore killed by SIGKILL (the out-of-memory killer, or a kill)"
    )
    exited = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}")
    assert core_start.explain(exited, CORE_LOG).endswith("(EngineCore exit code 1)")
    assert core_start.explain(RuntimeError(VLLM_SUMMARY), "no traceback here") == (
        "vLLM's engine core failed to start (its log holds no cause)"
    )
    assert core_start.explain(ValueError("max_model_len too large"), CORE_LOG) is None  # not the core's start


def test_the_log_is_read_from_where_the_start_began(tmp_path):
    log = tmp_path / "worker.err"
    log.write_text("(EngineCore_DP0 pid=1) KeyError: an earlier start's cause\n")
    saved = os.dup(2)
    try:
        with log.open("a") as f:
            os.dup2(f.fileno(), 2)  # this process's stderr is the file, as a Ray actor's is its log
        offset = core_start.stderr_offset()
        with log.open("a") as f:
            f.write(CORE_LOG)
        since = core_start.read_since(offset)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert offset == len("(EngineCore_DP0 pid=1) KeyError: an earlier start's cause\n")
    assert core_start.cause_in_log(since).startswith("ValueError: To serve")


def test_a_remote_exception_is_its_cause_not_rays_traceback():
    assert cause_line(remote(ValueError("bad shape"))) == "ValueError: bad shape"
    # async_rl's own errors are lines already; one raised through two processes is still the cause
    assert cause_line(remote(EngineStartError("vLLM's engine core failed to start: x"))) == "vLLM's engine core failed to start: x"
    assert cause_line(remote(remote(KeyError("w")))) == "KeyError: 'w'"
    assert cause_line(OSError("local: as it was")) == "local: as it was"


def test_an_actor_whose_process_died_says_how():
    context = ActorDiedErrorContext(
        error_message="The actor is dead because it was killed by `ray.kill`.", class_name="GeneratorEngine", pid=77,
        actor_id=b"\x01" * 16,
    )
    assert cause_line(ActorDiedError(context)) == "its process died: The actor is dead because it was killed by `ray.kill`."
    failed_init = ActorDiedError(remote(ValueError("no such model folder")))
    assert cause_line(failed_init) == "its constructor failed: ValueError('no such model folder')"


def test_a_start_that_keeps_failing_names_the_remote_cause():
    retry = StartRetry(2, 0.0, (RayTaskError,), sleep=lambda s: None)
    said = []
    killed = EngineStartError(core_start.explain(RuntimeError(VLLM_SUMMARY.replace("{}", "{'EngineCore': -9}")), ""))

    def start():
        raise remote(killed)

    with pytest.raises(StartsSpent) as spent:
        retry.run(start, "engine 1", said.append)
    assert said == ["engine 1: start 1 of 2 failed (vLLM's engine core failed to start: EngineCore killed by SIGKILL "
                    "(the out-of-memory killer, or a kill)); starting again in 0s"]
    assert str(spent.value).endswith("the last with: vLLM's engine core failed to start: EngineCore killed by SIGKILL "
                                     "(the out-of-memory killer, or a kill)")
