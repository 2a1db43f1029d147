"""Tools a model can call in a multi-turn episode. A tool returns text (the observation) and an
outcome counter key; it never raises for anything the model wrote."""

from __future__ import annotations

import abc
import ast
import math
import operator

import msgspec

from async_rl.envs.sandbox import SandboxLimits, run_python
from async_rl.envs.tool_calls import ArgValue


class ToolResult(msgspec.Struct, frozen=True):
    text: str  # what the model sees
    outcome: str  # 'ok', 'error', or a limit ('timeout', 'cpu_limit', 'output_limit', ...)


class Tool(abc.ABC):
    name: str
    description: str  # one line, shown to the model in the system prompt

    @abc.abstractmethod
    def run(self, arguments: dict[str, ArgValue]) -> ToolResult:
        """Blocking; called in a tool worker process or thread, never on an event loop."""

    @staticmethod
    def text_argument(arguments: dict[str, ArgValue], *names: str) -> str | None:
        """The first of `names` present as a string (formats differ: 'input', 'expression', 'code')."""
        for name in names:
            value = arguments.get(name)
            if isinstance(value, str):
                return value
        return None


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 1000  # 10**1000 is fine; 10**10**10 would hang the worker
_MAX_EXPRESSION = 500


def evaluate_arithmetic(expression: str) -> float | int:
    """+ - * / // % ** and parentheses over numbers; anything else raises ValueError."""
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def ev(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent above {_MAX_EXPONENT}")
            return _BINARY[type(node.op)](left, right)
        raise ValueError(f"'{ast.unparse(node)}' is not allowed (numbers and + - * / // % ** only)")

    try:
        value = ev(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("result too large") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not finite")
    return value


def format_number(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class Calculator(Tool):
    name = "calculator"
    description = "evaluates an arithmetic expression (+ - * / // % ** and parentheses), e.g. 12*(3+4)"

    def run(self, arguments: dict[str, ArgValue]) -> ToolResult:
        expression = self.text_argument(arguments, "input", "expression")
        if expression is None:
            return ToolResult("error: calculator needs an 'expression'", "error")
        try:
            return ToolResult(format_number(evaluate_arithmetic(expression)), "ok")
        except ValueError as exc:
            return ToolResult(f"error: {exc}", "error")


class PythonTool(Tool):
    name = "python"
    description = "runs a Python program in a sandbox (no network, time and memory limits) and returns what it prints"

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()

    def run(self, arguments: dict[str, ArgValue]) -> ToolResult:
        code = self.text_argument(arguments, "input", "code")
        if code is None:
            return ToolResult("error: python needs 'code'", "error")
        r = run_python(code, self.limits)
        outcome = r.outcome
        if outcome == "ok":
            return ToolResult(r.stdout if r.stdout else "(no output)", "ok")
        if outcome == "error":
            last = r.stderr.strip().splitlines()[-1:] or [f"exited with code {r.exit_code}"]
            return ToolResult(f"error: {last[0]}", "error")
        return ToolResult(f"error: {outcome.replace('_', ' ')} (stdout so far: {r.stdout[:200]!r})", outcome)


BUILTIN_TOOLS: dict[str, type[Tool]] = {"calculator": Calculator, "python": PythonTool}
