"""Runs one user agent in its own process: `python agent_main.py JOB_FILE RESULT_FILE`.

Self-contained on purpose (standard library and the `openai` SDK only, no async_rl import), so that
`env.python` may name another interpreter, e.g. a venv with packages whose pins conflict with ours.
The job (JSON) names the agent 'pkg.module:fn', the episode's base_url and key, and the prompt; fn is
called as fn(client, prompt, **extras), sync or async, where `client` is an `openai.OpenAI` (or
`openai.AsyncOpenAI` for an async fn) pointed at the episode's route, `prompt` the chat messages, and
extras those of model/answer/metadata/env_id that fn names (or all, with **kwargs). It returns the reward
(a number) or the final messages (a list of {"role", "content"}); the result is written as JSON.
"""

import asyncio
import importlib
import inspect
import json
import sys
import traceback


def _load(target):
    module_name, _, attr = target.partition(":")
    fn = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    return fn


def _extras(fn, offered):
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in params}


def _as_result(value):
    if isinstance(value, bool) or not isinstance(value, (int, float, list)):
        raise TypeError(f"the agent returned {type(value).__name__}: return a number (the reward) or the final messages")
    if isinstance(value, list):
        messages = []
        for m in value:
            if hasattr(m, "model_dump"):  # an openai SDK message object
                m = m.model_dump()
            if not isinstance(m, dict) or "role" not in m:
                raise TypeError("the agent's final messages must be dicts with 'role' and 'content'")
            messages.append({"role": str(m["role"]), "content": str(m.get("content") or "")})
        return {"messages": messages}
    return {"reward": float(value)}


def main(job_path, result_path):
    with open(job_path) as f:
        job = json.load(f)
    try:
        import openai

        fn = _load(job["target"])
        offered = {"model": job["model"], "answer": job["answer"], "metadata": job["metadata"], "env_id": job["env_id"]}
        extras = _extras(fn, offered)
        kwargs = {"base_url": job["base_url"], "api_key": job["api_key"], "max_retries": 0, "timeout": job["timeout_s"]}
        if inspect.iscoroutinefunction(fn):
            async def run():
                async with openai.AsyncOpenAI(**kwargs) as client:
                    return await fn(client, job["prompt"], **extras)

            value = asyncio.run(run())
        else:
            with openai.OpenAI(**kwargs) as client:
                value = fn(client, job["prompt"], **extras)
        result = _as_result(value)
    except BaseException as exc:  # the agent's own failure: reported as one line, counted by the engine
        tb = traceback.format_exc(limit=-3)
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": tb[-2000:]}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
