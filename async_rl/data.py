"""Prompt datasets: JSONL or parquet files in the verl-style layout. JSON lines are read line by line
with the standard library and parquet with pyarrow (not `datasets`, whose loader's errors named
neither the row nor the line): an unreadable file is one line naming the file, row and line.

A row holds a prompt (`data.prompt_key`: a string, or a list of chat messages {role, content}), an
answer (`data.answer_key`, a dotted path may reach into a nested column, e.g. verl's
`reward_model.ground_truth`), optionally a data source (`data.data_source_key`; missing: the file's
name), optionally images for a vision-language model (`data.image_key`: paths relative to the data
file's folder, bytes or datasets' image dicts, read into `Prompt.images`), and any other columns, kept
as `Prompt.metadata` (nested columns flattened to dotted keys, lists as JSON text). Rows are counted
from 0.

Every row is checked and rendered (see chat.py) when the files are loaded, at start-up: a bad row
(missing column, wrong type, empty prompt, an image that cannot be read or used, prompt longer than
the model allows) is a one-line `ConfigError` naming file and row, or with `data.skip_bad_rows` it is
skipped and counted by reason.
"""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from async_rl.chat import PromptRenderer, RenderError
from async_rl.config import Config, DataConfig
from async_rl.errors import ConfigError, first_line, typed_line
from async_rl.images import ImageError, check, image_bytes
from async_rl.protocol import ChatMessage, MetaValue, Prompt


class BadRow(ValueError):
    """One row that cannot be a prompt: `reason` is the counter it lands in, the message one line."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# The renderer's errors about one image (not the prompt's count of them): the row's error names the image.
ONE_IMAGE_REASONS = ("bad_image", "image_too_large")


class LoadedPrompts:
    """The rendered prompts of some files, in file and row order, and the rows skipped (by reason)."""

    def __init__(self, prompts: list[Prompt], skipped: collections.Counter[str]) -> None:
        self.prompts = prompts
        self.skipped = skipped


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a .jsonl/.json or .parquet file as a dict. Every way the file can be unreadable is
    a one-line ConfigError naming the file, and the row (and line) where there is one: gone, a
    directory, not permitted, empty, not UTF-8, a line that is not JSON or not an object, not parquet."""
    p = Path(path).expanduser()
    what = f"data file '{p}'"
    try:
        raw = p.read_bytes()
    except IsADirectoryError:
        raise ConfigError(f"{what} is a directory, not a file") from None
    except FileNotFoundError:
        raise ConfigError(f"{what} does not exist") from None
    except PermissionError:
        raise ConfigError(f"{what} cannot be opened: permission denied") from None
    except OSError as exc:
        raise ConfigError(f"{what} cannot be read: {exc.strerror or exc}") from None
    rows = _parquet_rows(raw, what) if p.suffix == ".parquet" else _json_rows(raw, what, whole=p.suffix == ".json")
    if not rows:
        raise ConfigError(f"{what} has no rows")
    return rows


def _parquet_rows(raw: bytes, what: str) -> list[dict[str, Any]]:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(io.BytesIO(raw)).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ConfigError(f"{what} cannot be read as parquet: {first_line(exc)}") from None


def _json_rows(raw: bytes, what: str, whole: bool) -> list[dict[str, Any]]:
    """JSON lines (one object a line, blank lines ignored), or with `whole` a .json file that holds one
    array of objects (a .json file of JSON lines is read as lines)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{what} is not UTF-8 text: byte {exc.start} (line {line}) is {raw[exc.start:exc.start + 1]!r}") from None
    if whole and text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{what} cannot be read as json: line {exc.lineno} column {exc.colno}: {exc.msg}") from None
        except (ValueError, RecursionError) as exc:  # a number too long to convert, nesting too deep
            raise ConfigError(f"{what} cannot be read as json: {typed_line(exc)}") from None
        lines = list(range(len(values)))  # rows of an array have no line of their own
        where = [f"row {i}" for i in lines]
    else:
        values, where = [], []
        # JSON lines end at "\n" (str.splitlines would also cut at U+2028, U+0085, ... which a JSON string
        # may hold as they are: json.dumps(ensure_ascii=False) writes them so)
        for n, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                values.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{what} cannot be read as json: row {len(values)} (line {n}) is not JSON: {exc.msg}") from None
            except (ValueError, RecursionError) as exc:  # a number too long to convert, nesting too deep
                raise ConfigError(f"{what} cannot be read as json: row {len(values)} (line {n}): {typed_line(exc)}") from None
            where.append(f"row {len(values) - 1} (line {n})")
    for value, at in zip(values, where, strict=True):
        if not isinstance(value, dict):
            raise ConfigError(f"{what} cannot be read as json: {at} is a {type(value).__name__}, not an object of columns")
    return values


def file_rows(files: list[str], field: str) -> Iterator[tuple[str, int, dict[str, Any], str]]:
    """(file, row index, row, where) for every row of `files` in order; `where` names the config key
    `field`, the file and the row for a one-line error."""
    for f in files:
        for i, row in enumerate(read_rows(f)):
            yield f, i, row, f"{field}: '{f}' row {i}"


def _field(row: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """(present, value) of a column or a dotted path into nested columns; None counts as missing."""
    node: Any = row
    for key in dotted.split("."):
        if not isinstance(node, dict) or node.get(key) is None:
            return False, None
        node = node[key]
    return True, node


def _flatten(prefix: str, value: Any, out: dict[str, MetaValue], skip: set[str]) -> None:
    """`value` into `out` under dotted keys, leaving out the columns in `skip` (and all below them)."""
    if prefix in skip:  # cut before flattening: an image column's bytes would be turned into text first
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out, skip)
    elif value is None or isinstance(value, (str, int, float, bool)):
        out[prefix] = value
    else:  # lists and other structures: kept as JSON text (metadata values are scalars)
        out[prefix] = json.dumps(value, default=str)


def _messages(value: list[Any], where: str, key: str) -> list[ChatMessage]:
    messages = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRow("wrong_type", f"{where}: column '{key}' message {j} is not {{role: str, content: str}}")
        messages.append(ChatMessage(role=m["role"], content=m["content"]))
    return messages


def _images(row: dict[str, Any], data: DataConfig, where: str, base_dir: Path | None) -> list[bytes]:
    """The encoded images of a row's image column (a list of cells, or one cell), read now so that a
    missing or unreadable file is this row's error at start-up, not a failed request later."""
    present, value = _field(row, data.image_key) if data.image_key else (False, None)
    if not present:
        return []
    cells = value if isinstance(value, list | tuple) else [value]
    images = []
    for j, cell in enumerate(cells):
        try:
            images.append(image_bytes(cell, base_dir))
        except ImageError as exc:
            raise BadRow(exc.reason, f"{where}: column '{data.image_key}' image {j}: {exc}") from None
    return images


def row_to_prompt(
    row: dict[str, Any], index: int, source_name: str, data: DataConfig, where: str, base_dir: Path | None = None
) -> Prompt:
    """One row -> an unrendered Prompt (prompt_id = row index); BadRow names `where` and why.
    `base_dir`: the folder an image's relative path is read from (the data file's; None: the working
    directory)."""
    present, value = _field(row, data.prompt_key)
    if not present:
        raise BadRow("missing_column", f"{where}: missing column '{data.prompt_key}'")
    text, messages = "", []
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):
        messages = _messages(value, where, data.prompt_key)
    else:
        raise BadRow(
            "wrong_type", f"{where}: column '{data.prompt_key}' is {type(value).__name__}, not a string or chat messages"
        )
    if not text.strip() and not any(m.content.strip() for m in messages):
        raise BadRow("empty_prompt", f"{where}: empty prompt in column '{data.prompt_key}'")
    answer = ""
    if data.answer_key:
        present, value = _field(row, data.answer_key)
        if not present:
            raise BadRow("missing_column", f"{where}: missing column '{data.answer_key}'")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise BadRow(
                "wrong_type", f"{where}: column '{data.answer_key}' is {type(value).__name__}, not a string or number"
            )
        answer = str(value)
    present, value = _field(row, data.data_source_key) if data.data_source_key else (False, None)
    if present and not isinstance(value, str):
        raise BadRow("wrong_type", f"{where}: column '{data.data_source_key}' is {type(value).__name__}, not a string")
    data_source = value if present else source_name
    images = _images(row, data, where, base_dir)
    metadata: dict[str, MetaValue] = {}
    consumed = {data.prompt_key, data.answer_key, data.data_source_key, data.image_key}
    for k, v in row.items():
        _flatten(k, v, metadata, consumed)
    return Prompt(
        prompt_id=index, text=text, messages=messages, answer=answer, data_source=data_source, metadata=metadata,
        images=images,
    )


def load_prompt_files(
    files: list[str], data: DataConfig, renderer: PromptRenderer, max_prompt_tokens: int, field: str
) -> LoadedPrompts:
    """Read, check and render every row of `files` (in order). A bad row raises a one-line
    ConfigError naming `field`, file and row, or is skipped and counted with data.skip_bad_rows."""
    prompts: list[Prompt] = []
    skipped: collections.Counter[str] = collections.Counter()
    for f, i, row, where in file_rows(files, field):
        try:
            prompt = row_to_prompt(row, i, Path(f).stem, data, where, Path(f).expanduser().absolute().parent)
            prompt = _rendered(renderer, prompt, max_prompt_tokens, row, data)
        except RenderError as exc:
            if not data.skip_bad_rows:
                raise ConfigError(f"{where}: {exc}{_hint(exc.reason, data)}") from None
            skipped[exc.reason] += 1
            continue
        except BadRow as exc:
            if not data.skip_bad_rows:
                raise ConfigError(str(exc)) from None
            skipped[exc.reason] += 1
            continue
        prompts.append(prompt)
    if not prompts and files:
        raise ConfigError(f"{field}: no usable row in {files} ({dict(skipped)} skipped)")
    return LoadedPrompts(prompts, skipped)


def _rendered(
    renderer: PromptRenderer, prompt: Prompt, max_tokens: int, row: dict[str, Any], data: DataConfig
) -> Prompt:
    """`renderer.rendered`, with an image it refuses named by its place in the image column (and its
    file): the renderer sees only bytes, and a row may hold several images."""
    try:
        return renderer.rendered(prompt, max_tokens)
    except RenderError as exc:
        if exc.reason not in ONE_IMAGE_REASONS:
            raise
        culprit = _refused_image(prompt.images, renderer.vision_settings.max_image_pixels)
        if culprit is None:
            raise
        _, value = _field(row, data.image_key)
        cell = (value if isinstance(value, list | tuple) else [value])[culprit]
        path = cell.get("path") if isinstance(cell, dict) else cell
        named = f" ('{path}')" if isinstance(path, str) and path else ""
        raise RenderError(exc.reason, f"column '{data.image_key}' image {culprit}{named}: {exc}") from None


def _refused_image(images: list[bytes], max_pixels: int) -> int | None:
    """The first image that fails the renderer's check; checked again only once the row has failed."""
    for j, data in enumerate(images):
        try:
            check(data, max_pixels)
        except ImageError:
            return j
    return None


def _hint(reason: str, data: DataConfig) -> str:
    """What to change when a text-only model meets a file with an image column."""
    if reason != "images_without_vision":
        return ""
    return f" (the images of column '{data.image_key}'; data.image_key='' reads none)"


def max_prompt_tokens(cfg: Config) -> int:
    """The longest prompt the model allows: what is left of max_model_len after the completion."""
    return cfg.generators.max_model_len - cfg.generators.max_tokens


def make_renderer(cfg: Config, model_dir: str | Path) -> PromptRenderer:
    """The run's prompt renderer: data.system_prompt with the environment's text (env) appended."""
    from async_rl.envs.factory import combined_system_prompt

    return PromptRenderer(
        model_dir, combined_system_prompt(cfg.data.system_prompt, cfg.env), cfg.data.chat_template_for_text,
        vision=cfg.vision,
    )


def check_train_data(cfg: Config, model_dir: str | Path) -> LoadedPrompts | None:
    """Start-up check of data.train_files and data.eval_files (one-line ConfigError on a bad row)."""
    if not cfg.data.train_files and not cfg.data.eval_files:
        return None
    renderer = make_renderer(cfg, model_dir)
    train = load_prompt_files(cfg.data.train_files, cfg.data, renderer, max_prompt_tokens(cfg), "data.train_files")
    load_prompt_files(cfg.data.eval_files, cfg.data, renderer, max_prompt_tokens(cfg), "data.eval_files")
    return train


def load_eval_prompts(
    cfg: Config, model_dir: str | Path, skipped: collections.Counter[str] | None = None
) -> list[Prompt]:
    """The rendered evaluation prompts, `data_source` set, `prompt_id` their index: every row of
    data.eval_files (file order), or else the first data.eval_task_prompts prompts of the task's
    stream under the held-out seed data.eval_task_seed. A task's bad prompt is skipped and counted
    in `skipped` (by reason); a bad file row follows data.skip_bad_rows.
    Called by evaluation (the controller); renders with the model's tokenizer, so call it once."""
    renderer = make_renderer(cfg, model_dir)
    limit = max_prompt_tokens(cfg)
    if cfg.data.eval_files:
        loaded = load_prompt_files(cfg.data.eval_files, cfg.data, renderer, limit, "data.eval_files")
        if skipped is not None:
            skipped.update(loaded.skipped)
        return [_renumbered(p, i) for i, p in enumerate(loaded.prompts)]
    from async_rl.tasks.registry import load_task

    out: list[Prompt] = []
    stream = load_task(cfg.task.name).prompts(cfg.data.eval_task_seed)
    for prompt in itertools.islice(stream, cfg.data.eval_task_prompts):
        try:
            rendered = renderer.rendered(prompt, limit)
        except RenderError as exc:  # a task's bad prompt: counted, skipped, never a crash
            if skipped is not None:
                skipped[exc.reason] += 1
            continue
        out.append(_renumbered(rendered, len(out), data_source=prompt.data_source or cfg.task.name))
    return out


def _renumbered(prompt: Prompt, prompt_id: int, data_source: str = "") -> Prompt:
    return msgspec.structs.replace(prompt, prompt_id=prompt_id, data_source=data_source or prompt.data_source)
