"""Chat demonstrations for supervised fine-tuning: one conversation per row (`sft.messages_key`: a
list of {role, content} messages with at least one assistant turn), rendered with the model's chat
template into token ids and a loss mask that is 1 on the assistant's tokens only.

The assistant's tokens are found from the template itself, whatever it is: for each assistant turn k,
the conversation up to turn k rendered with the generation prompt is the prefix before the turn, and
the conversation up to and including turn k is the prefix after it; the tokens between are the
assistant's (its text and its end-of-turn token; what the template writes after the model's EOS, a
newline, is not). A template whose renderings are not prefixes of each other cannot be split this way:
that row is a one-line error. Rows are counted from 0, errors name the file and the row."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from async_rl.chat import RenderError, apply_chat_template
from async_rl.config import SftConfig
from async_rl.data import BadRow, file_rows
from async_rl.errors import ConfigError
from async_rl.protocol import REWARD_OK, TOKEN_DTYPE, TrajectoryGroup


@dataclass(frozen=True)
class Demonstration:
    """One rendered conversation: its tokens, where the first assistant token is, the loss mask of
    the tokens from there on (1 on the assistant's), and whether it was cut at the length limit."""

    tokens: np.ndarray  # int32 [length]
    start: int  # the first assistant token: tokens before it are the prompt
    mask: np.ndarray  # uint8 [length - start]
    cut: bool


class Demonstrations:
    def __init__(self, items: list[Demonstration], skipped: collections.Counter[str]) -> None:
        self.items = items
        self.skipped = skipped  # conversations left out, by reason (every assistant token cut off)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def cut(self) -> int:
        return sum(d.cut for d in self.items)


class ChatTokenizer:
    """The model's chat template and tokenizer, as the prompt renderer uses them (text, then ids)."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        if not self.tok.chat_template:
            raise ConfigError(f"model '{model_dir}' has no chat template: sft needs one to render conversations")
        self.eos = self.tok.eos_token_id

    def ids(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        text = apply_chat_template(self.tok, messages, tokenize=False, add_generation_prompt=generation_prompt)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRow("wrong_type", f"{where}: column '{key}' is {type(value).__name__}, not a list of chat messages")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRow("wrong_type", f"{where}: column '{key}' message {j} is not {{role: str, content: str}}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow("no_assistant", f"{where}: column '{key}' has no assistant message to learn from")
    return out


def render(messages: list[dict[str, str]], chat: ChatTokenizer, where: str) -> tuple[list[int], list[int]]:
    """(token ids of the whole conversation, 0/1 per token: 1 on the assistant's)."""
    try:
        return _render(messages, chat, where)
    except RenderError as exc:
        raise BadRow(exc.reason, f"{where}: {exc}") from None


def _render(messages: list[dict[str, str]], chat: ChatTokenizer, where: str) -> tuple[list[int], list[int]]:
    full = chat.ids(messages, generation_prompt=False)
    mask = [0] * len(full)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = chat.ids(messages[:k], generation_prompt=True)
        after = chat.ids(messages[: k + 1], generation_prompt=False)
        if full[: len(before)] != before or full[: len(after)] != after or len(after) <= len(before):
            raise BadRow(
                "template_prefix",
                f"{where}: the chat template does not render assistant message {k} as an extension of the conversation "
                "before it: its tokens cannot be told apart",
            )
        end = len(after)
        turn = full[len(before) : end]
        if chat.eos is not None and chat.eos in turn:  # learn to stop, not what the template writes after
            end = len(before) + turn.index(chat.eos) + 1
        mask[len(before) : end] = [1] * (end - len(before))
    return full, mask


def demonstration(row: dict[str, Any], key: str, chat: ChatTokenizer, max_length: int, where: str) -> Demonstration:
    if key not in row or row[key] is None:
        raise BadRow("missing_column", f"{where}: missing column '{key}'")
    tokens, mask = render(_messages(row[key], where, key), chat, where)
    cut = len(tokens) > max_length
    tokens, mask = tokens[:max_length], mask[:max_length]
    if not any(mask):
        raise BadRow("too_long", f"{where}: no assistant token within the first {max_length} tokens")
    start = mask.index(1)
    return Demonstration(np.asarray(tokens, TOKEN_DTYPE), start, np.asarray(mask[start:], np.uint8), cut)


def load_demonstrations(files: list[str], key: str, chat: ChatTokenizer, max_length: int, field: str) -> Demonstrations:
    """Every row of `files` in order. A bad row is a one-line ConfigError naming `field`, the file and
    the row, except one whose assistant tokens all lie past `max_length`: left out and counted."""
    items: list[Demonstration] = []
    skipped: collections.Counter[str] = collections.Counter()
    for _, _, row, where in file_rows(files, field):
        try:
            items.append(demonstration(row, key, chat, max_length, where))
        except BadRow as exc:
            if exc.reason != "too_long":
                raise ConfigError(str(exc)) from None
            skipped[exc.reason] += 1
    if files and not items:
        raise ConfigError(f"{field}: no usable conversation in {files} ({dict(skipped)} skipped)")
    return Demonstrations(items, skipped)


def check_demonstrations(sft: SftConfig, model_dir: str | Path, max_length: int) -> None:
    """Every train and eval file read and rendered in the launching process, before anything starts: a
    bad file or row fails here in one line, not in the learner ranks after Ray has started (they read
    the files again)."""
    chat = ChatTokenizer(model_dir)
    load_demonstrations(sft.train_files, sft.messages_key, chat, max_length, "sft.train_files")
    load_demonstrations(sft.eval_files, sft.messages_key, chat, max_length, "sft.eval_files")


def as_group(d: Demonstration, index: int) -> TrajectoryGroup:
    """A demonstration in the learner's shape: a group of one sample whose completion is everything
    from the first assistant token on, its loss mask the assistant's tokens (as a multi-turn episode's)."""
    completion = d.tokens[d.start :]
    return TrajectoryGroup(
        prompt_id=index,
        engine_id=-1,
        prompt_tokens=d.tokens[: d.start],
        completions=[completion],
        logprobs=[np.zeros(len(completion), np.float32)],
        rewards=[0.0],
        version_first=[0],
        version_last=[0],
        reward_status=[REWARD_OK],
        loss_masks=[d.mask],
    )


def step_indices(n: int, batch: int, step: int, seed: int, shuffle: bool) -> list[int]:
    """The conversations of optimizer step `step`: positions step*batch ... of the stream of epochs,
    each epoch a permutation of the n conversations (seeded by `seed` and the epoch; in file order
    without `shuffle`). A pure function of the step: a resumed run draws exactly what it would have."""
    out = []
    for pos in range(step * batch, (step + 1) * batch):
        epoch, i = divmod(pos, n)
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        out.append(int(order[i]))
    return out
