"""The Environment interface for multi-turn episodes.

An episode starts from a prompt (chat messages), then alternates a model turn and an environment
turn (tool results, game feedback, a user simulator) until the environment says it is done or a
limit is hit (`max_turns`, total tokens). The environment sees the model's turn as text and answers
with chat messages; the episode runner (`episode.py`) keeps everything else token in / token out.
"""

from __future__ import annotations

import abc

import msgspec

from async_rl.protocol import ChatMessage, Prompt


class EnvTurn(msgspec.Struct, frozen=True, kw_only=True):
    """The environment's answer to one model turn."""

    messages: list[ChatMessage] = []  # appended to the conversation (rendered by the chat template)
    # Images the model sees next (a vision-language model: a tool's crop, a re-render), encoded files
    # (PNG, ...), one per `<image>` marker in `messages`, in order
    images: list[bytes] = []
    done: bool = False
    reward: float | None = None  # a per-turn reward (None: only the episode's final reward counts)
    tool_calls: int = 0  # well-formed calls of known tools in the model's turn
    tool_errors: int = 0  # malformed calls, unknown tools, tools that failed
    tool_outcomes: list[str] = []  # one counter key per call: 'ok', 'error', 'timeout', ...


class Episode(abc.ABC):
    """The state of one episode; made by `Environment.start` and used by one coroutine only."""

    @abc.abstractmethod
    async def step(self, model_text: str, finished: bool) -> EnvTurn:
        """React to the model's turn. `finished` is False when the turn was cut by the token limit
        (the environment may still answer, but the runner ends the episode)."""

    @abc.abstractmethod
    async def final_reward(self, transcript: list[ChatMessage]) -> float:
        """The episode's reward once it ended, given the whole conversation (model turns included)."""


class Environment(abc.ABC):
    """Makes episodes. Built once per engine from config; `start` is called per sampled episode."""

    name: str = "environment"

    def system_prompt(self) -> str:
        """Text the model must see in its system prompt (how to call the tools, the rules); appended to
        data.system_prompt when prompts are rendered, so it is in the prompt's token ids."""
        return ""

    @abc.abstractmethod
    def start(self, prompt: Prompt) -> Episode:
        """A fresh episode for `prompt` (several are started per prompt: the group)."""
