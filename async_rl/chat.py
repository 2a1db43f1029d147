"""Prompt rendering: a prompt (text or chat messages) -> the token ids the model generates from.

Rendered once, in the buffer's prompt source, with the model's own tokenizer: chat messages go
through its chat template with the generation prompt added (the assistant turn opened), so the
token ids vLLM generates from and the learner trains on are exactly what the template gives.
`data.system_prompt`, when set, is prepended as a system message (unless the prompt has its own).

A model without a chat template: text is tokenized as it is; chat messages are an error.
A model with one: text is rendered as one user message (`data.chat_template_for_text`, default on),
or tokenized as it is when that is off.

A prompt with images (`Prompt.images`) needs a vision-language model: its processor renders the chat
(its own chat template, images as content parts where the text has `<image>` markers, or before the
text) and expands each image's placeholder into the image's tokens at the run's pixel bounds
(`vision.*`), so `token_ids` hold what the engine's vLLM expands them to and the learner trains on.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import msgspec
from jinja2 import TemplateError

from async_rl.config import VisionConfig
from async_rl.errors import RunError, first_line
from async_rl.images import IMAGE_MARKER, ImageError
from async_rl.protocol import ChatMessage, Prompt
from async_rl.vision import VisionModel

ROLES = ("system", "user", "assistant", "tool")


class RenderError(ValueError):
    """A prompt that cannot become token ids: `reason` is the counter it lands in, the message one line."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]], **kwargs: Any) -> Any:
    """`tokenizer.apply_chat_template(messages, **kwargs)`; RenderError (`template_error`) when the
    template refuses the messages: a template may raise on its own ("roles must alternate"), or fail on a
    message it cannot take."""
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        raise RenderError("template_error", f"the chat template refused the messages: {first_line(exc)}") from None


@cache
def tokenizer_class_of(model_dir: str) -> str:
    """The name of the tokenizer class AutoTokenizer picks for `model_dir` where it is one of
    transformers' own ('' for anything else: remote code). AutoTokenizer decides from the model's
    config as well as the tokenizer's (the tiny preset's tokenizer file says TokenizersBackend, its
    model type gets Qwen2Tokenizer, which splits text differently), and reading a config imports torch
    (transformers' configuration module does): ~3 CPU-s more for a process that has no other use for
    torch, such as the buffer. So the launching process, which has torch anyway, asks once per folder
    and the buffer loads that class directly (`load_tokenizer`). Not a local folder: '' (the buffer's
    AutoTokenizer reports what is wrong, as it did before)."""
    import transformers

    if not Path(model_dir).is_dir():
        return ""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    name = type(tokenizer).__name__
    return name if getattr(transformers, name, None) is type(tokenizer) else ""


def load_tokenizer(model_dir: str | Path, tokenizer_class: str = "") -> Any:
    """The model's tokenizer: AutoTokenizer's, or with `tokenizer_class` (`tokenizer_class_of` the same
    folder) that class's `from_pretrained` on the folder, which is what AutoTokenizer calls once it
    has chosen the class, without AutoTokenizer's import of torch."""
    import transformers  # heavy: only where prompts are rendered

    if not tokenizer_class:
        return transformers.AutoTokenizer.from_pretrained(str(model_dir))
    cls = getattr(transformers, tokenizer_class, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        raise RunError(f"{model_dir}: tokenizer class {tokenizer_class!r} is not one of transformers' tokenizers")
    return cls.from_pretrained(str(model_dir))


class PromptRenderer:
    def __init__(
        self, model_dir: str | Path, system_prompt: str = "", template_for_text: bool = True, tokenizer_class: str = "",
        vision: VisionConfig | None = None,
    ) -> None:
        """`tokenizer_class`: `tokenizer_class_of(model_dir)` where the caller has it ('' = AutoTokenizer).
        `vision`: the run's image settings (a vision-language model's processor is loaded with them)."""
        self.tokenizer = load_tokenizer(model_dir, tokenizer_class)
        self.vision_settings = vision or VisionConfig()
        self.vision = VisionModel.of(model_dir, self.vision_settings)  # None: a text-only model
        self.has_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.system_prompt = system_prompt
        self.template_for_text = template_for_text

    def messages_of(self, prompt: Prompt) -> list[ChatMessage] | None:
        """The chat the template renders (system prompt included), or None: tokenize `text` as it is."""
        if prompt.messages:
            chat = list(prompt.messages)
        elif self.has_template and self.template_for_text:
            chat = [ChatMessage(role="user", content=prompt.text)]
        else:
            return None
        if self.system_prompt and chat[0].role != "system":
            chat.insert(0, ChatMessage(role="system", content=self.system_prompt))
        return chat

    def render(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids. RenderError: empty prompt, chat without a template, bad role, bad images."""
        if prompt.images:
            return self._render_with_images(prompt)
        if not prompt.messages and not prompt.text.strip():
            raise RenderError("empty_prompt", "empty prompt")
        if prompt.messages and not any(m.content.strip() for m in prompt.messages):
            raise RenderError("empty_prompt", "empty prompt (every message is empty)")
        if prompt.messages and not self.has_template:
            raise RenderError("no_chat_template", "chat messages, but the model's tokenizer has no chat template")
        chat = self.messages_of(prompt)
        if chat is None:
            return list(self.tokenizer.encode(prompt.text))
        for m in chat:
            if m.role not in ROLES:
                raise RenderError("bad_role", f"message role '{m.role}' is not one of {ROLES}")
        rendered: Any = apply_chat_template(
            self.tokenizer,
            [{"role": m.role, "content": m.content} for m in chat],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )
        return list(rendered["input_ids"])

    def _render_with_images(self, prompt: Prompt) -> list[int]:
        """A vision-language prompt through the model's processor (chat template, placeholders expanded)."""
        if self.vision is None:
            raise RenderError(
                "images_without_vision", f"the prompt has {len(prompt.images)} image(s) but the model has no vision tower"
            )
        limit = self.vision_settings.max_images_per_prompt
        if len(prompt.images) > limit:
            raise RenderError(
                "too_many_images", f"the prompt has {len(prompt.images)} images, more than vision.max_images_per_prompt={limit}"
            )
        chat = self.messages_of(prompt) or [ChatMessage(role="user", content=prompt.text)]
        markers = sum(m.content.count(IMAGE_MARKER) for m in chat)
        if markers and markers != len(prompt.images):
            raise RenderError(
                "image_count", f"{len(prompt.images)} image(s) for {markers} '{IMAGE_MARKER}' marker(s) in the prompt"
            )
        for m in chat:
            if m.role not in ROLES:
                raise RenderError("bad_role", f"message role '{m.role}' is not one of {ROLES}")
        try:
            return self.vision.render(
                [(m.role, m.content) for m in chat], prompt.images, self.vision_settings.max_image_pixels
            )
        except ImageError as exc:
            raise RenderError(exc.reason, str(exc)) from None

    def rendered(self, prompt: Prompt, max_tokens: int) -> Prompt:
        """`prompt` with its token ids; RenderError also when longer than `max_tokens` (0 = no limit)."""
        ids = self.render(prompt)
        if max_tokens and len(ids) > max_tokens:
            raise RenderError(
                "too_long",
                f"prompt of {len(ids)} tokens is longer than the model allows "
                f"({max_tokens} = generators.max_model_len - generators.max_tokens)"
            )
        return msgspec.structs.replace(prompt, token_ids=ids)
