"""The judge's prompt and its verdict, as pure functions: what a reward worker sends to the judge
(`render_judge_prompt`) and how the judge's reply becomes a reward (`parse_verdict`: None when it
cannot be read, which the caller counts; never a silent 0). A template is checked before a run
starts, by config loading (`config.check_judge_template`)."""

from __future__ import annotations

import math
import re

_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
# A number as judges write it: '7', '7.5', '-1', '.5'; '8/10' reads as 8 (the denominator is score_max).
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+(?:\.\d*)?)?")


def render_judge_prompt(template: str, question: str, completion: str, answer: str) -> str:
    """The judge's user message: the template with the sample's parts put in (never re-parsed, so
    braces inside a completion are kept as they are)."""
    return template.format(question=question, completion=completion, answer=answer)


def parse_verdict(reply: str, kind: str, score_max: float) -> float | None:
    """The reward a judge's reply gives: yes_no reads the last whole word YES or NO (1.0 or 0.0);
    score reads the last number and maps it to [0, 1] as score / score_max (clipped). None when the
    reply holds no verdict (the caller counts it as unparseable)."""
    if kind == "yes_no":
        found = _YES_NO.findall(reply)
        if not found:
            return None
        return 1.0 if found[-1].lower() == "yes" else 0.0
    if kind == "score":
        found = _NUMBER.findall(reply)
        if not found:
            return None
        value = float(found[-1].split("/")[0])
        if not math.isfinite(value):
            return None
        return min(1.0, max(0.0, value / score_max))
    raise ValueError(f"unknown verdict kind {kind!r}")
