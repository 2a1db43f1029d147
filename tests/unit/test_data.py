"""Prompt data: JSONL and parquet loading, bad rows named by file and row, chat rendering equal to
the tokenizer's own chat template, seeded shuffling per epoch, and the stream position restored."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from async_rl.buffer.actor import BufferSettings, BufferState, ReplayBuffer
from async_rl.buffer.prompt_source import DataPosition, DatasetStream, PromptSource
from async_rl.chat import PromptRenderer, RenderError
from async_rl.config import DataConfig, load_config
from async_rl.data import load_eval_prompts, load_prompt_files, read_rows
from async_rl.errors import ConfigError, RunError
from async_rl.models.tiny import resolve_model_path
from async_rl.protocol import ChatMessage, Prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny preset's folder (character tokenizer, no chat template)."""
    return resolve_model_path("tiny-qwen2", str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, smollm2) -> Path:
    """A model folder with a chat template: SmolLM2's tokenizer files (no weights needed to render)."""
    d = tmp_path_factory.mktemp("smol-tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        if (smollm2 / name).is_file():
            (d / name).write_bytes((smollm2 / name).read_bytes())
    return d


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


VERL_ROWS = [
    {
        "data_source": "arith",
        "prompt": [{"role": "user", "content": "What is 2+3?"}],
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"index": 0, "split": "train"},
    },
    {
        "data_source": "arith",
        "prompt": [{"role": "user", "content": "What is 4+4?"}],
        "reward_model": {"style": "rule", "ground_truth": "8"},
        "extra_info": {"index": 1, "split": "train"},
    },
]
VERL = DataConfig(answer_key="reward_model.ground_truth")


# ---- loading -----------------------------------------------------------------------------------


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet])
def test_verl_layout_loads_from_jsonl_and_parquet(tmp_path, chat_model, writer):
    path = writer(tmp_path / ("d.jsonl" if writer is write_jsonl else "d.parquet"), VERL_ROWS)
    renderer = PromptRenderer(chat_model)
    loaded = load_prompt_files([path], VERL, renderer, 0, "data.train_files")
    assert len(loaded.prompts) == 2 and not loaded.skipped
    p = loaded.prompts[1]
    assert p.messages == [ChatMessage(role="user", content="What is 4+4?")]
    assert p.answer == "8" and p.data_source == "arith"
    # Other columns are kept as scalar metadata, nested ones under dotted keys; the answer is not.
    assert p.metadata == {"reward_model.style": "rule", "extra_info.index": 1, "extra_info.split": "train"}
    assert p.token_ids == renderer.render(p) and p.token_ids


def test_text_prompts_numbers_as_answers_and_data_source_from_the_file_name(tmp_path, tiny):
    path = write_jsonl(tmp_path / "letters.jsonl", [{"prompt": "a:", "answer": 7, "tags": [1, 2]}])
    (p,) = load_prompt_files([path], DataConfig(), PromptRenderer(tiny), 0, "data.train_files").prompts
    assert p.text == "a:" and p.answer == "7" and p.data_source == "letters"
    assert p.metadata == {"tags": "[1, 2]"}  # a list is kept as JSON text


BAD_ROWS = [
    ({"answer": "1"}, "missing column 'prompt'"),
    ({"prompt": "a:"}, "missing column 'answer'"),
    ({"prompt": 5, "answer": "1"}, "column 'prompt' is int, not a string or chat messages"),
    ({"prompt": "a:", "answer": ["1"]}, "column 'answer' is list, not a string or number"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "message 0 is not {role: str, content: str}"),
    ({"prompt": "  ", "answer": "1"}, "empty prompt"),
    ({"prompt": "a" * 200, "answer": "1"}, "prompt of 200 tokens is longer than the model allows (100"),
]


@pytest.mark.parametrize("bad,message", BAD_ROWS)
def test_a_bad_row_is_one_line_naming_file_and_row(tmp_path, tiny, bad, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a:", "answer": "1"}, {"prompt": "b:", "answer": "2"}, bad])
    with pytest.raises(ConfigError) as err:
        load_prompt_files([path], DataConfig(), PromptRenderer(tiny), 100, "data.train_files")
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"data.train_files: '{path}' row 2: ") and message in text


def test_bad_rows_are_skipped_and_counted_when_asked(tmp_path, tiny):
    rows = [{"prompt": "a:", "answer": "1"}] + [bad for bad, _ in BAD_ROWS]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = DataConfig(skip_bad_rows=True)
    loaded = load_prompt_files([path], data, PromptRenderer(tiny), 100, "data.train_files")
    assert [p.text for p in loaded.prompts] == ["a:"]
    assert dict(loaded.skipped) == {"missing_column": 2, "wrong_type": 3, "empty_prompt": 1, "too_long": 1}


def test_wrong_type_in_a_parquet_column_and_an_unreadable_file(tmp_path, tiny):
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": 1, "answer": "1"}])
    with pytest.raises(ConfigError, match=r"d.parquet' row 0: column 'prompt' is int"):
        load_prompt_files([path], DataConfig(), PromptRenderer(tiny), 0, "data.eval_files")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a:", "answer": "1"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"data file '.*broken.jsonl' cannot be read as json: .*row 1"):
        read_rows(broken)


def test_data_config_names_missing_or_unknown_files(tmp_path):
    with pytest.raises(ConfigError, match=r"data.train_files: '.*nope.jsonl' does not exist"):
        load_config(None, [f"data.train_files=[{tmp_path / 'nope.jsonl'}]"])
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(ConfigError, match=r"data.eval_files: '.*d.csv' is not a .jsonl/.json/.parquet file"):
        load_config(None, [f"data.eval_files=[{tmp_path / 'd.csv'}]"])


# ---- rendering ----------------------------------------------------------------------------------


def test_chat_rendering_is_the_tokenizers_chat_template_with_generation_prompt(chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    chat = [{"role": "user", "content": "What is 12*3?"}]
    want = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    renderer = PromptRenderer(chat_model)
    assert renderer.render(Prompt(prompt_id=0, messages=[ChatMessage(role="user", content="What is 12*3?")])) == want
    assert renderer.render(Prompt(prompt_id=0, text="What is 12*3?")) == want  # text = one user message
    # The system prompt comes first; the text ends with the opened assistant turn.
    with_system = PromptRenderer(chat_model, system_prompt="Answer briefly.")
    sys_chat = [{"role": "system", "content": "Answer briefly."}, *chat]
    ids = with_system.render(Prompt(prompt_id=0, text="What is 12*3?"))
    assert ids == tok.apply_chat_template(sys_chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert tok.decode(ids).endswith("<|im_start|>assistant\n") and "Answer briefly." in tok.decode(ids)
    plain = PromptRenderer(chat_model, template_for_text=False)
    assert plain.render(Prompt(prompt_id=0, text="What is 12*3?")) == tok.encode("What is 12*3?")


# a template that raises on its own, as many do ("roles must alternate")
REFUSING_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns here') }}"
                     "{% endif %}{{ m['content'] }}{% endfor %}")


def test_a_row_the_chat_template_refuses_is_one_line_naming_file_and_row(tmp_path, chat_model):
    rows = [{"prompt": [{"role": "user", "content": "a"}], "answer": "1"},
            {"prompt": [{"role": "user", "content": "b"}, {"role": "tool", "content": "c"}], "answer": "2"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    renderer = PromptRenderer(chat_model)
    renderer.tokenizer.chat_template = REFUSING_TEMPLATE
    with pytest.raises(ConfigError) as err:
        load_prompt_files([path], DataConfig(), renderer, 0, "data.train_files")
    text = str(err.value)
    assert "\n" not in text
    assert text == f"data.train_files: '{path}' row 1: the chat template refused the messages: no tool turns here"
    skipping = load_prompt_files([path], DataConfig(skip_bad_rows=True), renderer, 0, "data.train_files")
    assert len(skipping.prompts) == 1 and dict(skipping.skipped) == {"template_error": 1}


def test_a_model_without_chat_template_tokenizes_text_and_refuses_chat(tiny):
    from transformers import AutoTokenizer

    renderer = PromptRenderer(tiny)
    assert renderer.render(Prompt(prompt_id=0, text="c:")) == AutoTokenizer.from_pretrained(str(tiny)).encode("c:")
    with pytest.raises(RenderError, match="no chat template") as err:
        renderer.render(Prompt(prompt_id=0, messages=[ChatMessage(role="user", content="c:")]))
    assert err.value.reason == "no_chat_template"


@pytest.mark.parametrize("preset", ["tiny", "chat_model"])
def test_the_named_tokenizer_class_renders_as_autotokenizer_does(preset, request):
    """The buffer loads the class AutoTokenizer picks (named by the launching process) directly: the
    same class and the same ids for text and chat, system prompt included. The tiny preset is the case
    where the tokenizer file alone names another class (TokenizersBackend) that splits differently."""
    from transformers import AutoTokenizer

    from async_rl.chat import tokenizer_class_of

    folder = str(request.getfixturevalue(preset))
    name = tokenizer_class_of(folder)
    assert name == type(AutoTokenizer.from_pretrained(folder)).__name__
    auto = PromptRenderer(folder, system_prompt="Be brief.")
    named = PromptRenderer(folder, system_prompt="Be brief.", tokenizer_class=name)
    assert type(named.tokenizer) is type(auto.tokenizer)
    cases = [Prompt(prompt_id=0, text="hello 12+3 = ?\n  x")]
    if auto.has_template:
        cases.append(Prompt(prompt_id=1, messages=[ChatMessage(role="user", content="What is 7*6? Think.")]))
    for p in cases:
        assert named.render(p) == auto.render(p)


def test_the_buffers_renderer_does_not_import_torch(tiny):
    """What the named class buys: a buffer rendering prompts starts without torch (~3 CPU-s less)."""
    import subprocess
    import sys

    from async_rl.chat import tokenizer_class_of

    code = (
        "import sys; from async_rl.buffer.prompt_source import PromptSource; from async_rl.config import DataConfig; "
        f"PromptSource.from_settings('repeat', 0, {str(tiny)!r}, 100, DataConfig(), {tokenizer_class_of(str(tiny))!r}); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_a_tokenizer_class_that_is_not_transformers_is_one_line(tiny):
    with pytest.raises(RunError, match="tokenizer class 'Nope' is not one of transformers' tokenizers"):
        PromptRenderer(tiny, tokenizer_class="Nope")


# ---- the stream: epochs, shuffle, position ------------------------------------------------------


def prompts(n: int) -> list[Prompt]:
    return [Prompt(prompt_id=i, text=f"row {i}") for i in range(n)]


def drain(stream) -> list[str]:
    out = []
    while (p := stream.next()) is not None:
        out.append(p.text)
    return out


def test_each_epoch_is_a_seeded_permutation_and_the_stream_ends_after_the_last():
    rows = prompts(20)
    a = drain(DatasetStream(rows, epochs=3, shuffle=True, seed=7, skipped=None))
    b = drain(DatasetStream(rows, epochs=3, shuffle=True, seed=7, skipped=None))
    assert a == b and len(a) == 60  # same seed, same order; three passes, then the end
    epochs = [a[0:20], a[20:40], a[40:60]]
    assert all(sorted(e) == sorted(p.text for p in rows) for e in epochs)  # every row once per epoch
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch
    assert a != drain(DatasetStream(rows, epochs=3, shuffle=True, seed=8, skipped=None))
    assert drain(DatasetStream(rows, epochs=1, shuffle=False, seed=7, skipped=None)) == [p.text for p in rows]


def test_prompt_ids_are_unique_over_epochs():
    stream = DatasetStream(prompts(5), epochs=2, shuffle=True, seed=0, skipped=None)
    ids = []
    while (p := stream.next()) is not None:
        ids.append(p.prompt_id)
    assert sorted(ids) == list(range(10))


def test_restored_position_gives_the_same_next_prompts():
    rows = prompts(7)
    whole = PromptSource(DatasetStream(rows, epochs=3, shuffle=True, seed=1, skipped=None))
    first = whole.take(10)  # into the second epoch
    pos, drawn = whole.position, whole.drawn
    assert pos == DataPosition(epoch=1, index=3) and drawn == 10
    rest = whole.take(100)
    resumed = PromptSource(DatasetStream(rows, epochs=3, shuffle=True, seed=1, skipped=None))
    resumed.seek(msgspec.json.decode(msgspec.json.encode(pos), type=DataPosition), drawn)
    assert resumed.take(100) == rest and len(first + rest) == 21 and resumed.exhausted


def buffer_settings(model_dir: Path, data: DataConfig, task: str = "repeat") -> BufferSettings:
    return BufferSettings(
        run_id="r", host="127.0.0.1", ingest_port=0, serve_port=0, max_lag=1, prompts_per_step=2, group_size=2,
        filter_uniform_groups=False, max_frame_bytes=1 << 20, task_name=task, task_seed=0,
        model_dir=str(model_dir), max_prompt_tokens=100, data=data,
    )


def test_buffer_checkpoint_keeps_the_data_position_and_resume_continues_there(tmp_path, tiny):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{c}:", "answer": c} for c in "abcdefg"])
    data = DataConfig(train_files=[path], epochs=2, seed=3)

    async def scenario():
        old = ReplayBuffer(buffer_settings(tiny, data))
        leased = await old.lease(engine_id=0, max_groups=3, wait_s=0)
        assert all(p.token_ids for p in leased)  # rendered before the lease
        state = msgspec.json.decode(msgspec.json.encode(old.checkpoint_state()), type=BufferState)
        assert state.position == DataPosition(epoch=0, index=3)
        old.ledger.generator_version = 5  # admission open for the rest of the data
        rest = [p.text for p in await old.lease(engine_id=0, max_groups=20, wait_s=0)]
        new = ReplayBuffer(buffer_settings(tiny, data))
        await new.restore(state)
        assert new.stats().data_position == DataPosition(epoch=0, index=3)
        new.ledger.generator_version = 20
        again = await new.lease(engine_id=1, max_groups=20, wait_s=0)
        # The 3 in flight at checkpoint time first, then exactly the prompts the old run drew next.
        assert [p.text for p in again[:3]] == [p.text for p in leased]
        assert [p.text for p in again[3:]] == rest and len(rest) == 11
        assert await new.lease(engine_id=1, max_groups=1, wait_s=0) == [] and new.stats().prompts_exhausted

    asyncio.run(scenario())


def test_a_tasks_bad_prompts_are_counted_and_skipped(tmp_path, tiny):
    async def scenario():
        buf = ReplayBuffer(buffer_settings(tiny, DataConfig(), task="tests.unit._mixed_task:make_task"))
        leased = await buf.lease(engine_id=0, max_groups=4, wait_s=0)
        assert [p.text for p in leased] == ["a:", "d:"] and all(p.data_source == "tests.unit._mixed_task:make_task" for p in leased)
        assert buf.stats().skipped_prompts == {"empty_prompt": 1, "too_long": 1, "no_chat_template": 1}
        assert buf.stats().data_position == DataPosition(epoch=0, index=5)
        state = buf.checkpoint_state()
        assert state.skipped_prompts == {"empty_prompt": 1, "too_long": 1, "no_chat_template": 1}

    asyncio.run(scenario())


# ---- the evaluation set ------------------------------------------------------------------------


def test_eval_prompts_from_files_in_file_order(tmp_path, tiny):
    path = write_jsonl(tmp_path / "held.jsonl", [{"prompt": f"{c}:", "answer": c} for c in "xyz"])
    cfg = load_config(None, [f"data.eval_files=[{path}]"])
    got = load_eval_prompts(cfg, tiny)
    assert [(p.prompt_id, p.text, p.data_source) for p in got] == [(0, "x:", "held"), (1, "y:", "held"), (2, "z:", "held")]
    assert all(p.token_ids for p in got)


def test_eval_prompts_from_a_tasks_held_out_seed(tiny):
    cfg = load_config(None, ["task.name=modsum", "data.eval_task_prompts=5"])
    got = load_eval_prompts(cfg, tiny)
    assert len(got) == 5 and all(p.data_source == "modsum" and p.token_ids for p in got)
    from async_rl.tasks.modsum import ModSumTask

    train = [p.text for p in itertools_take(ModSumTask().prompts(0), 5)]
    held = [p.text for p in itertools_take(ModSumTask().prompts(cfg.data.eval_task_seed), 5)]
    assert [p.text for p in got] == held != train
    with pytest.raises(ConfigError, match="data.eval_task_seed=0 equals task.seed"):
        load_config(None, ["data.eval_task_seed=0"])


def itertools_take(it, n):
    import itertools

    return list(itertools.islice(it, n))


def test_a_restarted_buffer_continues_the_data_from_its_snapshot(tmp_path, tiny):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{c}:", "answer": c} for c in "abcde"])
    s = msgspec.structs.replace(
        buffer_settings(tiny, DataConfig(train_files=[path], epochs=2, seed=1)), snapshot_path=str(tmp_path / "snap")
    )

    async def scenario():
        old = ReplayBuffer(s)
        held = await old.lease(engine_id=0, max_groups=4, wait_s=0)  # the stream stands at epoch 0, index 4
        old.save_snapshot()
        old.ledger.generator_version = 9
        after = await old.lease(engine_id=0, max_groups=3, wait_s=0)  # crosses into epoch 1
        new = ReplayBuffer(msgspec.structs.replace(s, restore=True))  # the buffer died and restarts
        assert new.stats().data_position == DataPosition(epoch=0, index=4)
        new.ledger.generator_version = 9
        again = await new.lease(engine_id=1, max_groups=7, wait_s=0)
        assert again == held + after  # the leases it never saw again first, then the same stream

    asyncio.run(scenario())


def test_the_buffer_gets_absolute_data_paths(tmp_path, monkeypatch):
    from async_rl.control.settings import buffer_settings as settings_for

    (tmp_path / "train.jsonl").write_text('{"prompt": "a:", "answer": "a"}\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["data.train_files=[train.jsonl]", "generators.max_model_len=64", "generators.max_tokens=8"])
    s = settings_for(cfg, "r", None, Path("m"))
    assert s.data.train_files == [str(tmp_path / "train.jsonl")] and s.max_prompt_tokens == 56
