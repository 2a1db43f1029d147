"""Multi-turn building blocks: tool-call parsing, tools, the sandbox, and token-level episodes."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from async_rl.envs.episode import ChatDelta, ModelTurn, model_token_logprobs, run_episode
from async_rl.envs.guess import GuessNumberEnvironment, game_prompt
from async_rl.envs.sandbox import SandboxLimits, network_isolation, run_python
from async_rl.envs.tool_calls import ToolCall, parse_turn
from async_rl.envs.tool_env import ToolEnvironment
from async_rl.envs.tools import Calculator, PythonTool, evaluate_arithmetic
from async_rl.protocol import ChatMessage, Prompt

TOOLS = {"calculator", "python"}

# SmolLM2-Instruct's chat template (ChatML with a default system message).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer():
    return build_chat_tokenizer()


def build_chat_tokenizer():
    """A small byte-level BPE tokenizer with ChatML special tokens, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["I am thinking of a number. Guess it: higher lower correct 50 25 37 system user"] * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>")
    hf.chat_template = CHATML
    return hf


# ---- tool-call parsing ---------------------------------------------------------------------------


def test_parse_hermes_calls_in_order():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
        ' and <tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    )
    parsed = parse_turn(text, "hermes", TOOLS)
    assert parsed.calls == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("python", {"code": "print(1)"})]
    assert parsed.errors == [] and not parsed.is_final


def test_parse_tag_call_and_final_answer():
    parsed = parse_turn('First <tool name="calculator">12*(3+4)</tool>', "tag", TOOLS)
    assert parsed.calls == [ToolCall("calculator", {"input": "12*(3+4)"})]
    assert parse_turn("The answer is 84.", "tag", TOOLS).is_final


@pytest.mark.parametrize(
    ("fmt", "text", "reason"),
    [
        ("hermes", "<tool_call>{not json}</tool_call>", "malformed"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>', "malformed"),
        ("hermes", '<tool_call>{"name": "calculator", "arguments": {"x": [1]}}</tool_call>', "malformed"),
        ("hermes", '<tool_call>{"name": "calculator"', "malformed"),
        ("hermes", '<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown_tool"),
        ("tag", '<tool name="calculator">1+1', "malformed"),
        ("tag", '<tool name="web">cats</tool>', "unknown_tool"),
    ],
)
def test_parse_bad_calls_become_errors(fmt, text, reason):
    parsed = parse_turn(text, fmt, TOOLS)
    assert parsed.calls == []
    assert [e.reason for e in parsed.errors] == [reason]
    assert not parsed.is_final  # the model attempted a call: it gets the error, not a score


def test_parse_mixed_turn_keeps_good_calls_and_reports_each_bad_one():
    text = (
        '<tool name="calculator">2*3</tool> then <tool name="search">cats</tool>'
        ' and <tool name="python">print(1)</tool> and <tool name="calculator">7'
    )
    parsed = parse_turn(text, "tag", TOOLS)
    assert parsed.calls == [ToolCall("calculator", {"input": "2*3"}), ToolCall("python", {"input": "print(1)"})]
    assert [e.reason for e in parsed.errors] == ["unknown_tool", "malformed"]  # in the order written
    assert "search" in parsed.errors[0].message and "calculator, python" in parsed.errors[0].message


def test_tool_episode_answers_bad_calls_with_error_observations():
    prompt = Prompt(prompt_id=0, text="q", answer="6")
    env = ToolEnvironment([Calculator()], reward=lambda s: 0.0, fmt="hermes")
    turn = asyncio.run(
        env.start(prompt).step(
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
            "<tool_call>{oops}</tool_call>"
            '<tool_call>{"name": "web", "arguments": {}}</tool_call>',
            finished=True,
        )
    )
    assert not turn.done
    assert (turn.tool_calls, turn.tool_errors) == (1, 3)  # the call ran but failed, plus two bad calls
    assert sorted(turn.tool_outcomes) == ["error", "malformed", "unknown_tool"]
    assert all(m.role == "tool" for m in turn.messages)
    texts = [m.content for m in turn.messages]
    assert all(t.startswith(("error: ", "calculator: error: ")) for t in texts)
    assert "calculator: error: division by zero" in texts


# ---- tools -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("expr", "value"), [("12*(3+4)", 84), ("7/2", 3.5), ("-2**3", -8), ("17 // 5 % 3", 0)])
def test_calculator_evaluates(expr, value):
    assert evaluate_arithmetic(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "1/0", "10**10**10", "x+1", "1 +"])
def test_calculator_refuses(expr):
    result = Calculator().run({"input": expr})
    assert result.outcome == "error" and result.text.startswith("error: ")


def test_calculator_formats_whole_floats():
    assert Calculator().run({"expression": "6/3"}).text == "2"


# ---- the sandbox -----------------------------------------------------------------------------------


def test_sandbox_runs_code_and_returns_output():
    r = run_python("print(sum(range(10)))")
    assert (r.stdout, r.exit_code, r.outcome) == ("45\n", 0, "ok")


def test_sandbox_refuses_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    r = run_python(code)
    # A connection that reached the listener waits in its backlog: a non-blocking accept finds it.
    server.setblocking(False)
    accepted: list[socket.socket] = []
    try:
        accepted.append(server.accept()[0])
    except BlockingIOError:
        pass
    server.close()
    assert "connected" not in r.stdout
    assert r.outcome == "error" and ("unreachable" in r.stderr or "disabled" in r.stderr), r.stderr
    assert accepted == []  # nothing reached the listener on the host's loopback
    assert network_isolation() in ("namespace", "socket-stub")


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sandbox_killed_past_wall_time_with_its_children():
    code = (
        "import os, sys, time\npid = os.fork()\n"
        "if pid == 0:\n    time.sleep(60)\n    sys.exit()\n"
        "print(os.getpid(), pid, flush=True)\ntime.sleep(60)"
    )
    r = run_python(code, SandboxLimits(wall_s=1.0))
    assert r.timed_out and r.outcome == "timeout"
    assert r.wall_s < 10
    pids = [int(p) for p in r.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # SIGKILL is delivered asynchronously
    assert not any(_alive(p) for p in pids), "the sandboxed process or its child outlived the timeout"


def test_sandbox_cpu_memory_and_output_limits():
    assert run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=20)).outcome == "cpu_limit"
    mem = run_python("x = bytearray(1 << 31)", SandboxLimits(memory_mb=256))
    assert mem.outcome == "error" and "MemoryError" in mem.stderr
    out = run_python("print('x' * 100000)", SandboxLimits(output_bytes=1000))
    assert out.outcome == "output_limit" and len(out.stdout) <= 1000


@pytest.mark.parametrize("prlimit", [True, False], ids=["prlimit", "preexec_fn"])
def test_sandboxed_code_runs_under_exactly_the_configured_limits_in_its_own_session(prlimit, monkeypatch):
    import shutil

    if not prlimit:  # a machine without util-linux prlimit: the limits are set between fork and exec
        which = shutil.which
        monkeypatch.setattr(shutil, "which", lambda name: None if name == "prlimit" else which(name))
    elif shutil.which("prlimit") is None:
        pytest.skip("no prlimit on this machine")
    code = (
        "import os, resource as r\n"
        "print([r.getrlimit(x) for x in (r.RLIMIT_CPU, r.RLIMIT_AS, r.RLIMIT_FSIZE, r.RLIMIT_NOFILE, r.RLIMIT_CORE)])\n"
        "print(os.getsid(0) == os.getpid())\n"
    )
    res = run_python(code, SandboxLimits(cpu_s=2, memory_mb=300, output_bytes=5000))
    mem = 300 * 1024 * 1024
    assert res.outcome == "ok", res.stderr
    assert res.stdout.split("\n")[:2] == [str([(2, 3), (mem, mem), (5000, 5000), (64, 64), (0, 0)]), "True"]


def test_python_tool_reports_errors_and_limits():
    tool = PythonTool(SandboxLimits(wall_s=1.0))
    assert tool.run({"code": "print(6*7)"}).text == "42\n"
    assert tool.run({"input": "1/0"}).text == "error: ZeroDivisionError: division by zero"
    assert tool.run({"code": "import time; time.sleep(5)"}).outcome == "timeout"


# ---- token-level episodes --------------------------------------------------------------------------


def scripted(tokenizer, turns: list[str], logprob: float = -0.5):
    """A 'model' that answers with the given turns; each ends with the end-of-turn token."""
    eos = tokenizer.eos_token_id
    calls: list[list[int]] = []
    it = iter(turns)

    async def generate(ids: list[int], budget: int) -> ModelTurn:
        calls.append(list(ids))
        text = next(it)
        toks = tokenizer.encode(text, add_special_tokens=False) + [eos]
        lps = [logprob - 0.01 * i for i in range(len(toks))]
        return ModelTurn(toks, lps, text, "stop", version=len(calls) - 1)

    return generate, calls


def render(tokenizer, messages, add_generation_prompt):
    out = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_three_turn_episode_masks_and_logprobs_line_up(chat_tokenizer):
    tok = chat_tokenizer
    prompt = game_prompt(7, 1, 100, seed=0)
    secret = int(prompt.answer)
    guesses = [str(secret - 10), str(secret + 5), str(secret)]
    generate, calls = scripted(tok, guesses)
    prompt_ids = render(tok, prompt.messages, add_generation_prompt=True)
    result = asyncio.run(
        run_episode(
            GuessNumberEnvironment(turn_penalty=0.1).start(prompt),
            prompt_ids,
            list(prompt.messages),
            generate,
            ChatDelta(tok, tok.eos_token_id),
            max_turns=5,
            max_total_tokens=4096,
        )
    )
    assert result.turns == 3 and result.finish_reason == "stop"
    assert result.reward == pytest.approx(0.8)  # solved on the third guess
    assert result.turn_versions == [0, 1, 2]
    # The learner trains on exactly what the model saw: each turn was generated from the running ids.
    full = result.prompt_ids + result.completion_ids
    for i, seen in enumerate(calls):
        assert full[: len(seen)] == seen, f"turn {i} saw other tokens than the episode kept"
    # Model tokens: mask 1 and their own log-probs, in order; environment tokens: mask 0, no log-prob.
    model_tokens = [t for t, m in zip(result.completion_ids, result.loss_mask, strict=True) if m]
    expected = [t for g in guesses for t in tok.encode(g, add_special_tokens=False) + [tok.eos_token_id]]
    assert model_tokens == expected
    lps = model_token_logprobs(result)
    assert len(lps) == len(expected) and all(lps < 0)
    env_positions = [i for i, m in enumerate(result.loss_mask) if not m]
    assert env_positions and all(result.logprobs[i] == 0.0 for i in env_positions)
    env_text = tok.decode([result.completion_ids[i] for i in env_positions])
    assert "higher" in env_text and "lower" in env_text and "<|im_start|>assistant" in env_text
    # Token for token what the chat template renders for the whole conversation (up to its final newline).
    whole = render(tok, result.transcript, add_generation_prompt=False)
    assert whole[: len(full)] == full


def test_tool_episode_counts_calls_and_errors(chat_tokenizer):
    tok = chat_tokenizer
    prompt = Prompt(prompt_id=1, messages=[ChatMessage("user", "What is 12*(3+4)?")], answer="84")
    generate, _ = scripted(
        tok,
        ['<tool name="calculator">12*(3+4)</tool>', '<tool name="web">84?</tool>', "The answer is 84."],
    )
    env = ToolEnvironment([Calculator()], reward=lambda s: float(s.completion.endswith("84.")), fmt="tag")
    result = asyncio.run(
        run_episode(
            env.start(prompt),
            render(tok, prompt.messages, True),
            list(prompt.messages),
            generate,
            ChatDelta(tok, tok.eos_token_id),
            max_turns=4,
            max_total_tokens=4096,
        )
    )
    assert (result.turns, result.tool_calls, result.tool_errors) == (3, 1, 1)
    assert result.tool_outcomes == {"ok": 1, "unknown_tool": 1}
    assert result.reward == 1.0
    assert [m.content for m in result.transcript if m.role == "tool"] == [
        "calculator: 84",
        "error: unknown tool 'web' (tools: calculator)",
    ]


def test_episode_stops_at_the_token_budget(chat_tokenizer):
    tok = chat_tokenizer
    prompt = game_prompt(3, 1, 100, seed=0)
    generate, _ = scripted(tok, ["1", "2", "3", "4", "5"])
    prompt_ids = render(tok, prompt.messages, True)
    result = asyncio.run(
        run_episode(
            GuessNumberEnvironment().start(prompt),
            prompt_ids,
            list(prompt.messages),
            generate,
            ChatDelta(tok, tok.eos_token_id),
            max_turns=5,
            max_total_tokens=len(prompt_ids) + 12,
        )
    )
    assert result.finish_reason == "length"
    assert len(result.prompt_ids) + len(result.completion_ids) <= len(prompt_ids) + 12
    assert result.reward == 0.0


# ---- verifiers environments ------------------------------------------------------------------------


def test_verifiers_env_without_a_verifiers_interpreter_is_a_one_line_config_error():
    from async_rl.config import EnvConfig
    from async_rl.envs.verifiers_env import build
    from async_rl.errors import ConfigError

    with pytest.raises(ConfigError) as info:  # this interpreter has no verifiers (tests/unit/test_verifiers.py)
        build("vf-math", EnvConfig(name="verifiers:vf-math"), reward=lambda s: 0.0)
    message = str(info.value)
    assert "\n" not in message and "env.name 'verifiers:vf-math'" in message and "does not import verifiers" in message


def test_call_bonus_is_paid_once_for_a_turn_whose_calls_all_ran_ok(chat_tokenizer):
    tok = chat_tokenizer
    prompt = Prompt(prompt_id=1, messages=[ChatMessage("user", "What is 12*7?")], answer="84")
    turns = ['<tool name="calculator">1/0</tool>', '<tool name="calculator">12*7</tool>',
             '<tool name="calculator">84</tool>', "The answer is 84."]

    def run(bonus: float, reward: float):
        generate, _ = scripted(tok, turns)
        env = ToolEnvironment([Calculator()], reward=lambda s: reward, fmt="tag", call_bonus=bonus)
        return asyncio.run(run_episode(env.start(prompt), render(tok, prompt.messages, True), list(prompt.messages),
                                       generate, ChatDelta(tok, tok.eos_token_id), max_turns=4, max_total_tokens=4096))

    assert run(0.0, 1.0).reward == 1.0  # off by default: the task's reward only
    assert run(0.2, 1.0).reward == pytest.approx(1.2)  # the failed call earns nothing, two ok calls earn it once
    assert run(0.2, 0.0).reward == pytest.approx(0.2)
    with pytest.raises(ValueError, match="call_bonus"):
        ToolEnvironment([Calculator()], reward=lambda s: 0.0, call_bonus=-1.0)
