"""Run one multi-turn episode token in / token out, and keep what the learner needs.

The conversation is never re-tokenized: the prompt is rendered once, each model turn appends the
tokens the model sampled (loss mask 1, with their behaviour log-probs and the policy version that
produced them), and each environment turn appends only the new messages rendered by the chat
template (`ChatDelta`: loss mask 0, no log-probs). So the learner trains on exactly what the model saw.

A vision-language model's environment may show it images (`EnvTurn.images`): the delta renders them with
the model's processor (`envs/vision_delta.py`, each placeholder expanded) and the episode keeps them
(`EpisodeImages`): every later model turn is generated from all the images so far.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import msgspec
import numpy as np

from async_rl.envs.base import Episode
from async_rl.protocol import ChatMessage


class ModelTurn(msgspec.Struct, frozen=True):
    """What one generation call returned for the running token ids."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # 'stop' (end of turn), 'length', 'abort'
    version: int  # the policy version that generated it (first version if it spans a weight update)


# (token ids so far, max new tokens) -> the model's next turn
GenerateTurn = Callable[[list[int], int], Awaitable[ModelTurn]]


class EpisodeImages:
    """The images an episode's environment has shown so far, shared by the episode runner (which adds
    them) and the caller's `generate` (which sends them with each turn, after the prompt's).

    vLLM gives an image's features to the placeholders of the token ids in order, so no placeholder the
    policy sampled may come before an image's: an environment turn with images after a model turn that
    sampled the placeholder token ends the episode (`placeholder_sampled`) instead of being shown."""

    def __init__(self, image_token_id: int, prompt_len: int, max_images: int) -> None:
        self.image_token_id = image_token_id
        self.images: list[bytes] = []
        self.span = prompt_len  # tokens up to the last image's placeholders (the prompt's, at first)
        self.max_images = max_images  # the episode's own images at most (vLLM's per-request limit, less the prompt's)

    def refusal(self, images: list[bytes], completion: list[int], mask: list[int]) -> str | None:
        """Why a turn's images cannot be shown after `completion` so far (the finish reason), or None."""
        if len(self.images) + len(images) > self.max_images:
            return "max_images"
        if any(t == self.image_token_id and m for t, m in zip(completion, mask, strict=True)):
            return "placeholder_sampled"
        return None


class EpisodeResult(msgspec.Struct, kw_only=True):
    prompt_ids: list[int]
    completion_ids: list[int]  # every token after the prompt: model and environment turns
    loss_mask: list[int]  # per completion token: 1 = the model's, 0 = the environment's
    logprobs: list[float]  # per completion token: behaviour log-prob (0.0 on environment tokens)
    turn_versions: list[int]  # policy version of each model turn
    turns: int  # model turns
    tool_calls: int
    tool_errors: int
    tool_outcomes: dict[str, int]
    reward: float  # final reward plus the sum of per-turn rewards
    # 'stop' (environment done), 'max_turns', 'length' (token budget), 'abort'; with images:
    # 'max_images' or 'placeholder_sampled' (an environment turn's images could not be shown)
    finish_reason: str
    transcript: list[ChatMessage]
    images: list[bytes] = []  # the environment's images, in the order of their placeholders


R = TypeVar("R")


def first_that_renders(make: Callable[[int], R], stop_ids: list[int], who: str) -> R:
    """`make(token)` for the first of the model's stop tokens it accepts as the end of an assistant
    turn (it raises ValueError for the others); one line naming every refusal otherwise."""
    errors = []
    for token in stop_ids:
        try:
            return make(token)
        except ValueError as exc:
            errors.append(str(exc))
    raise RuntimeError(f"{who}: cannot render chat turns: {'; '.join(errors) or 'the model has no stop token'}")


class ChatDelta:
    """Tokens that the chat template puts after a finished assistant turn for `messages`, plus the
    generation prompt of the next assistant turn. Rendered against a fixed two-message context, so
    the cost does not grow with the conversation."""

    def __init__(self, tokenizer, end_of_turn_id: int, open_turns: bool = False) -> None:
        """`open_turns`: a template that writes no end-of-turn token after an assistant turn (the tiny
        vision preset's, which has no roles) is accepted: the model's stop token, which it sampled, ends
        its turn, and the delta is everything the template renders after the assistant's text."""
        self.tokenizer = tokenizer
        self.end_of_turn_id = end_of_turn_id
        self._context = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        base = self._render(self._context, add_generation_prompt=False)
        ends = [i for i, t in enumerate(base) if t == end_of_turn_id]
        if not ends and not open_turns:
            raise ValueError(f"the chat template does not end an assistant turn with token {end_of_turn_id}")
        self._prefix = base[: ends[-1] + 1] if ends else base  # up to and including the assistant's end-of-turn token

    @classmethod
    def for_model(cls, tokenizer, stop_ids: list[int], who: str) -> ChatDelta:
        """The delta whose end-of-turn token is the first of the model's stop tokens that its chat
        template ends an assistant turn with. `who` names the user in the error ('env=guess')."""
        return first_that_renders(lambda token: cls(tokenizer, token), stop_ids, who)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def __call__(self, messages: Sequence[ChatMessage], images: Sequence[bytes] = ()) -> list[int]:
        if images:
            raise ValueError(f"an environment turn with {len(images)} image(s) for a model without a vision tower")
        full = self._render(
            self._context + [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True
        )
        if full[: len(self._prefix)] != self._prefix:
            raise ValueError("the chat template renders earlier turns differently once more messages follow")
        return full[len(self._prefix) :]


async def run_episode(
    episode: Episode,
    prompt_ids: list[int],
    prompt_messages: list[ChatMessage],
    generate: GenerateTurn,
    render_delta: Callable[[Sequence[ChatMessage], Sequence[bytes]], list[int]],
    max_turns: int,
    max_total_tokens: int,
    images: EpisodeImages | None = None,
) -> EpisodeResult:
    """Alternate model and environment turns until the environment is done or a limit is reached.

    `max_total_tokens` bounds prompt + everything appended; an environment turn that would not leave
    room for one more model token ends the episode ('length'). `images`: a vision-language model's
    episode, which keeps the environment's images (None: an environment turn with images is an error)."""
    ids = list(prompt_ids)
    completion: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    transcript = list(prompt_messages)
    calls = errors = 0
    outcomes: dict[str, int] = {}
    turn_rewards = 0.0
    finish = "max_turns"
    for _ in range(max_turns):
        budget = max_total_tokens - len(ids)
        if budget <= 0:
            finish = "length"
            break
        turn = await generate(ids, budget)
        if len(turn.logprobs) != len(turn.token_ids):
            raise ValueError(f"model turn has {len(turn.token_ids)} tokens but {len(turn.logprobs)} log-probs")
        ids += turn.token_ids
        completion += turn.token_ids
        mask += [1] * len(turn.token_ids)
        logprobs += turn.logprobs
        versions.append(turn.version)
        transcript.append(ChatMessage("assistant", turn.text))
        if turn.finish_reason != "stop":
            finish = turn.finish_reason  # cut by the token budget or an abort: no environment turn
            break
        env = await episode.step(turn.text, finished=True)
        calls += env.tool_calls
        errors += env.tool_errors
        for key in env.tool_outcomes:
            outcomes[key] = outcomes.get(key, 0) + 1
        if env.reward is not None:
            turn_rewards += env.reward
        if env.done:
            finish = "stop"
            break
        if env.images and images is not None and (why := images.refusal(env.images, completion, mask)):
            finish = why
            break
        delta = render_delta(env.messages, env.images)
        if len(ids) + len(delta) >= max_total_tokens:
            finish = "length"
            break
        if env.images and images is not None:
            images.images += env.images
            # the new placeholders are the delta's last image tokens: every later turn keeps them whole
            last = max(i for i, t in enumerate(delta) if t == images.image_token_id)
            images.span = len(ids) + last + 1
        ids += delta
        completion += delta
        mask += [0] * len(delta)
        logprobs += [0.0] * len(delta)
        transcript.extend(env.messages)
    reward = await episode.final_reward(transcript) + turn_rewards
    return EpisodeResult(
        prompt_ids=list(prompt_ids),
        completion_ids=completion,
        loss_mask=mask,
        logprobs=logprobs,
        turn_versions=versions,
        turns=len(versions),
        tool_calls=calls,
        tool_errors=errors,
        tool_outcomes=outcomes,
        reward=reward,
        finish_reason=finish,
        transcript=transcript,
        images=list(images.images) if images is not None else [],
    )


def model_token_logprobs(result: EpisodeResult) -> np.ndarray:
    """The behaviour log-probs of the model's tokens only, in order (what the loss uses)."""
    mask = np.asarray(result.loss_mask, dtype=bool)
    return np.asarray(result.logprobs, dtype=np.float32)[mask]
