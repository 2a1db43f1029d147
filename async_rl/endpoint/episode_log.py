"""What the endpoint records for one agent episode, and the trained segments built from it.

Every call keeps the exact prompt token ids the engine generated from and, per choice, the sampled
ids, their behaviour log-probs and the policy versions. Segments are built from those ids only:
a call whose prompt extends the segment so far (prompt + every token after it) adds the new prompt
tokens as an environment part (loss mask 0) and its completion as a model part (loss mask 1). A call
that does not extend it (the agent rewrote or dropped history, or the template is not append-only)
starts a new segment: a prefix break. Nothing is re-tokenized.
"""

from __future__ import annotations

import msgspec
import numpy as np

from async_rl.endpoint.openai_types import Message, ToolCallOut, ToolSpec
from async_rl.serving.sampling import SamplingSpec


class Choice(msgspec.Struct, kw_only=True):
    """One sampled completion of a call."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # 'stop' | 'length' | 'abort'
    version_first: int  # policy version when the call started
    version_last: int  # policy version when it ended (later when a weight update landed inside it)
    routes: np.ndarray | None = None  # MoE routes of the call's prompt + this choice (generators.capture_routes)


class CallRecord(msgspec.Struct, kw_only=True):
    prompt_ids: list[int]
    choices: list[Choice]
    chosen: int = 0  # the choice the episode went on with (set when a later call extends one of them)
    images: list[bytes] = []  # a vision-language call's images, in the order of their placeholders
    images_span: int = 0  # its prompt's tokens up to the last image's placeholders (0: no images)


class Segment(msgspec.Struct, kw_only=True):
    """A trained sequence: exactly the tokens the model saw, in order."""

    prompt_ids: list[int]  # the first call's prompt
    completion_ids: list[int] = []  # everything after it: model parts and environment parts
    loss_mask: list[int] = []  # 1 = sampled by the model, 0 = the environment's (the agent's messages)
    logprobs: list[float] = []  # behaviour log-prob per completion token (0.0 on environment tokens)
    turn_versions: list[int] = []  # the policy version each call started on
    version_last: int = 0
    finish_reason: str = "stop"  # the last call's
    # MoE routes: each model part's call input ids and routes (serving/engine_routes.sequence_routes)
    turn_routes: list[tuple[list[int], np.ndarray]] = []
    images: list[bytes] = []  # its images, in the order of their placeholders (its last call's)

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add_model_part(self, choice: Choice, prompt_ids: list[int]) -> None:
        if choice.routes is not None:
            self.turn_routes.append((prompt_ids, choice.routes))
        self.completion_ids += choice.token_ids
        self.loss_mask += [1] * len(choice.token_ids)
        self.logprobs += choice.logprobs
        self.turn_versions.append(choice.version_first)
        self.version_last = choice.version_last
        self.finish_reason = choice.finish_reason


def _extends(ids: list[int], prefix: list[int]) -> bool:
    return len(ids) >= len(prefix) and ids[: len(prefix)] == prefix


def chosen_choice(calls: list[CallRecord], k: int) -> int:
    """Which choice of call k the episode went on with: the one the next call's prompt extends, else
    the recorded one (the first, unless the endpoint spliced another)."""
    call = calls[k]
    if len(call.choices) > 1 and k + 1 < len(calls):
        nxt = calls[k + 1].prompt_ids
        for j, c in enumerate(call.choices):
            if _extends(nxt, call.prompt_ids + c.token_ids):
                return j
    return call.chosen


def build_segments(calls: list[CallRecord]) -> list[Segment]:
    """The episode's trained segments, in call order; len - 1 of them are prefix breaks."""
    segments: list[Segment] = []
    for k, call in enumerate(calls):
        choice = call.choices[chosen_choice(calls, k)]
        current = segments[-1] if segments else None
        # extends the segment: its tokens, and its images (equal placeholders may hold other pixels)
        if (
            current is not None
            and _extends(call.prompt_ids, so_far := current.tokens())
            and call.images[: len(current.images)] == current.images
        ):
            env = call.prompt_ids[len(so_far) :]
            current.completion_ids += env
            current.loss_mask += [0] * len(env)
            current.logprobs += [0.0] * len(env)
        else:
            current = Segment(prompt_ids=list(call.prompt_ids))
            segments.append(current)
        current.images = list(call.images)
        current.add_model_part(choice, call.prompt_ids)
    return segments


def _same_calls(sent: list[ToolCallOut] | None, ours: list[ToolCallOut]) -> bool:
    sent = sent or []
    if len(sent) != len(ours):
        return False
    try:
        return all(
            a.function.name == b.function.name
            and msgspec.json.decode(a.function.arguments or "{}") == msgspec.json.decode(b.function.arguments or "{}")
            for a, b in zip(sent, ours, strict=True)
        )
    except msgspec.DecodeError:
        return False


class Reply(msgspec.Struct, kw_only=True):
    """The assistant message the endpoint returned for one choice (what the agent sends back)."""

    content: str | None
    tool_calls: list[ToolCallOut]


class EpisodeLog:
    """The calls of one episode, in the order they were served."""

    def __init__(self, episode_id: str, sampling: SamplingSpec, max_calls: int) -> None:
        self.episode_id = episode_id
        self.sampling = sampling  # the run's (or the evaluation's) sampling: what a call leaves unset
        self.max_calls = max_calls
        self.calls: list[CallRecord] = []
        self._last_messages: list[bytes] = []  # the last chat call's messages, JSON-encoded
        self._last_tools: bytes = b""
        self._last_replies: list[Reply] = []
        self._last_ends_turn: list[bool] = []  # per choice: ends with the template's end-of-turn token

    def splice(self, messages: list[Message], tools: list[ToolSpec] | None) -> tuple[list[int], int, int] | None:
        """When `messages` are the last chat call's messages, one of its replies, then only new
        non-assistant messages: (the last prompt + that choice's sampled ids, the choice, where the
        new messages start). None otherwise (the caller renders the whole conversation)."""
        if not self.calls or not self._last_messages:
            return None
        n = len(self._last_messages)
        if len(messages) <= n + 1 or msgspec.json.encode(tools) != self._last_tools:
            return None
        if [msgspec.json.encode(m) for m in messages[:n]] != self._last_messages:
            return None
        reply, new = messages[n], messages[n + 1 :]
        if reply.role != "assistant" or any(m.role == "assistant" for m in new):
            return None
        last = self.calls[-1]
        for j, ours in enumerate(self._last_replies):
            if not self._last_ends_turn[j]:
                continue
            if reply.text() == (ours.content or "") and _same_calls(reply.tool_calls, ours.tool_calls):
                last.chosen = j
                return last.prompt_ids + last.choices[j].token_ids, j, n + 1
        return None

    def record_chat(
        self,
        call: CallRecord,
        messages: list[Message],
        tools: list[ToolSpec] | None,
        replies: list[Reply],
        ends_turn: list[bool],
    ) -> None:
        self.calls.append(call)
        self._last_messages = [msgspec.json.encode(m) for m in messages]
        self._last_tools = msgspec.json.encode(tools)
        self._last_replies = replies
        self._last_ends_turn = ends_turn

    def record_completion(self, call: CallRecord) -> None:
        self.calls.append(call)
        self._last_messages = []  # a text completion ends the chat splice chain
