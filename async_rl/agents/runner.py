"""Runs a user agent in its own process with a time limit: a crash or a hang costs only its episode.

One process per episode (`agent_main.py`, started by `env.python` or this interpreter, in its own
session). At the time limit its whole process group is killed. The outcome is typed: ok (a reward
or final messages), error (the agent raised; one line), timeout, crash (the process died without a
result)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

import msgspec

from async_rl.envs.interpreter import child_env
from async_rl.protocol import ChatMessage

AGENT_MAIN = Path(__file__).with_name("agent_main.py")


class AgentJob(msgspec.Struct, frozen=True, kw_only=True):
    target: str  # 'pkg.module:fn'
    base_url: str
    api_key: str
    model: str
    prompt: list[dict[str, Any]]  # the chat messages the agent starts from (OpenAI's: images as image_url parts)
    answer: str = ""
    metadata: dict = {}
    timeout_s: float = 300.0
    env_id: str = ""  # env.name 'verifiers:ID': the ID, passed to the bridge agent ('' for agent:...)


class AgentOutcome(msgspec.Struct, frozen=True, kw_only=True):
    status: Literal["ok", "error", "timeout", "crash"]
    reward: float | None = None
    messages: list[ChatMessage] | None = None
    error: str = ""


class _Result(msgspec.Struct, kw_only=True):
    reward: float | None = None
    messages: list[ChatMessage] | None = None
    error: str | None = None
    traceback: str = ""


async def run_agent(job: AgentJob, python: str = "") -> AgentOutcome:
    python = python or sys.executable
    with tempfile.TemporaryDirectory(prefix="async_rl_agent_") as tmp:
        job_path, result_path = Path(tmp, "job.json"), Path(tmp, "result.json")
        job_path.write_bytes(msgspec.json.encode(job))
        job_path.chmod(0o600)  # it holds the endpoint's key
        proc = await asyncio.create_subprocess_exec(
            python, str(AGENT_MAIN), str(job_path), str(result_path),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, env=child_env(python),
        )
        try:
            _, stderr = await asyncio.wait_for(proc.communicate(), timeout=job.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            _kill_group(proc.pid)
            await proc.wait()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return AgentOutcome(status="timeout", error=f"the agent ran past env.agent_timeout_s={job.timeout_s:g}")
        _kill_group(proc.pid)  # whatever the agent left running (its own subprocesses) ends with it
        if not result_path.exists():
            tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            return AgentOutcome(status="crash", error=f"the agent's process died: {tail[0]}")
        try:
            result = msgspec.json.decode(result_path.read_bytes(), type=_Result)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return AgentOutcome(status="crash", error=f"unreadable agent result: {exc}")
    if result.error is not None:
        return AgentOutcome(status="error", error=result.error)
    return AgentOutcome(status="ok", reward=result.reward, messages=result.messages)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def job_prompt(messages: list[ChatMessage], images: list[bytes] | None = None) -> list[dict[str, Any]]:
    """The agent's prompt: OpenAI chat messages. A vision-language prompt's images become image_url
    parts with data URLs where its text has `<image>` markers (none: before the first user message's
    text), so the agent can send them on as they are."""
    if not images:
        return [{"role": m.role, "content": m.content} for m in messages]
    from async_rl.images import IMAGE_MARKER

    urls = iter(data_url(data) for data in images)
    marked = any(IMAGE_MARKER in m.content for m in messages)
    out: list[dict[str, Any]] = []
    for m in messages:
        parts: list[dict[str, Any]] = []
        if not marked and m.role == "user" and not any(o["role"] == "user" for o in out):
            parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
        for i, piece in enumerate(m.content.split(IMAGE_MARKER)):
            if i:
                parts.append({"type": "image_url", "image_url": {"url": next(urls)}})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": m.role, "content": parts})
    return out


def data_url(data: bytes) -> str:
    """An encoded image as a data URL (its format from its header; PNG when PIL does not say)."""
    import base64
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        kind = (im.format or "png").lower()
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"
