"""Supervised fine-tuning (train.mode=sft): the assistant mask from the chat template, the loss on
assistant tokens only (equal to a hand computation of the NLL with HF), the step's batch a pure
function of the step, a resume mid-SFT that continues exactly, and one-line errors for bad rows."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl.config import ConfigError, SftConfig, load_config
from async_rl.models.tiny import resolve_model_path
from async_rl.sft.data import ChatTokenizer, as_group, load_demonstrations, render, step_indices
from async_rl.sft.learner import SftLearner
from tests._presets import model_cache
from tests.unit._learner_fixtures import settings

# A chat template in the tiny model's characters: role initial, ':', content, EOS after the assistant's
# turns, then '. ' (which the model must not learn: it comes after its EOS).
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
    "{% endif %}. {% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny preset with a chat template."""
    folder = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(resolve_model_path("tiny-qwen2", model_cache()), folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder


def conversation(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": f"{i}+{i + 1}=?"},
        {"role": "assistant", "content": f"{2 * i + 1}"},
        {"role": "user", "content": "sure?"},
        {"role": "assistant", "content": f"yes {2 * i + 1}"},
    ]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_mask_covers_the_assistants_tokens_and_its_eos_only(chat_model):
    chat = ChatTokenizer(chat_model)
    tokens, mask = render(conversation(3), chat, "here")
    tok = chat.tok
    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    masked = [t for t, m in zip(tokens, mask, strict=True) if m]
    assert masked == ids("7") + [tok.eos_token_id] + ids("yes 7") + [tok.eos_token_id]  # both turns, each with its EOS
    unmasked = [t for t, m in zip(tokens, mask, strict=True) if not m]
    assert unmasked == ids("s:be brief. u:3+4=?. a:. u:sure?. a:. ")  # system, users, the template's own text


def test_the_sft_loss_is_the_nll_of_the_assistant_tokens_only(chat_model, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": conversation(i)} for i in range(4)])
    rank = SftLearner(settings(chat_model, sft=SftConfig(train_files=[data], batch_size=4, shuffle=False)), 0, 1, "", [])
    rank.setup()
    # by hand with HF: -mean log p over the masked (assistant) positions of the 4 conversations
    model = AutoModelForCausalLM.from_pretrained(str(chat_model), dtype=torch.float32).eval()
    chat = ChatTokenizer(chat_model)
    nll, count = 0.0, 0
    for i in range(4):
        tokens, mask = render(conversation(i), chat, "")
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0, :-1].double(), -1)
        picked = logp.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        m = torch.tensor(mask[1:], dtype=torch.float64)
        nll -= float((picked * m).sum())
        count += int(m.sum())
    metrics = rank.sft_step(0)
    assert metrics.loss == pytest.approx(nll / count, rel=1e-5)
    assert metrics.tokens == sum(len(render(conversation(i), chat, "")[0]) - as_group(
        rank.demos.items[i], i).prompt_tokens.size for i in range(4))
    rank.shutdown()


def test_changing_a_non_assistant_token_target_leaves_the_loss_gradient_alone(chat_model, tmp_path):
    """The gradient of the loss w.r.t. the log-probs is 0 outside the mask: a user token weighs nothing."""
    from async_rl.learner.batch.padded import PaddedShard
    from async_rl.sft.learner import SupervisedLoss

    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": conversation(i)} for i in range(2)])
    chat = ChatTokenizer(chat_model)
    demos = load_demonstrations([data], "messages", chat, 512, "sft.train_files")
    shard = PaddedShard([as_group(d, i) for i, d in enumerate(demos.items)])
    algo = SupervisedLoss(settings(chat_model).algorithm, max_tokens=8, temperature=1.0, model_dir="",
                          dtype=torch.float32, hidden_size=0, seed=0, max_grad_norm=1.0)
    p = algo.prepare(shard, lambda _: (None, None))
    logp = torch.full(shard.loss_mask.shape, -2.0, requires_grad=True)
    loss, _ = algo.loss(p, logp)
    loss.backward()
    assert torch.equal(logp.grad != 0, shard.loss_mask != 0)
    assert float(loss.detach()) == pytest.approx(2.0)  # every assistant token at log-prob -2


def test_step_batches_are_a_pure_function_of_the_step():
    a = [step_indices(10, 4, s, seed=7, shuffle=True) for s in range(5)]  # two epochs
    assert a == [step_indices(10, 4, s, seed=7, shuffle=True) for s in range(5)]
    flat = sum(a, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # a new order each epoch
    assert step_indices(10, 4, 1, seed=0, shuffle=False) == [4, 5, 6, 7]


def test_a_resume_mid_sft_continues_exactly(chat_model, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": conversation(i)} for i in range(6)])
    spec = settings(chat_model, sft=SftConfig(train_files=[data], batch_size=2), total_steps=4)

    def rank() -> SftLearner:
        r = SftLearner(spec, 0, 1, "", [])
        r.setup()
        return r

    straight = rank()
    want = [straight.sft_step(s).loss for s in range(4)]
    want_weights = {k: v.clone() for k, v in straight.hf_weights().items()}
    straight.shutdown()
    first = rank()
    got = [first.sft_step(s).loss for s in range(2)]
    first.save_checkpoint(str(tmp_path / "ck"))
    first.shutdown()
    resumed = rank()
    assert resumed.load_checkpoint(str(tmp_path / "ck")) == 2
    got += [resumed.sft_step(s).loss for s in range(2, 4)]
    weights = resumed.hf_weights()
    resumed.shutdown()
    assert got == want  # the same batches, weights, optimizer state and schedule: bit for bit
    assert all(torch.equal(weights[k], want_weights[k]) for k in want_weights)


@pytest.mark.parametrize(
    ("row", "words"),
    [
        ({"other": 1}, "missing column 'messages'"),
        ({"messages": "hi"}, "is str, not a list of chat messages"),
        ({"messages": [{"role": "user"}]}, "message 0 is not {role: str, content: str}"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant message"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_and_row(chat_model, tmp_path, row, words):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": conversation(0)}, row])
    with pytest.raises(ConfigError) as exc:
        load_demonstrations([data], "messages", ChatTokenizer(chat_model), 512, "sft.train_files")
    line = str(exc.value)
    assert "\n" not in line and f"sft.train_files: '{data}' row 1" in line and words in line


def test_a_conversation_the_chat_template_refuses_is_one_line_naming_file_and_row(chat_model, tmp_path):
    tool_turn = [{"role": "user", "content": "1+2=?"}, {"role": "tool", "content": "3"},
                 {"role": "assistant", "content": "3"}]
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": conversation(0)}, {"messages": tool_turn}])
    chat = ChatTokenizer(chat_model)
    chat.tok.chat_template = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError) as exc:
        load_demonstrations([data], "messages", chat, 512, "sft.train_files")
    assert str(exc.value) == (f"sft.train_files: '{data}' row 1: the chat template refused the messages: no tool turns")


def test_the_launch_refuses_a_bad_demonstration_before_anything_starts(chat_model, tmp_path, capsys):
    """One line on stderr naming the file and row, exit 2, no run directory, no Ray."""
    from async_rl import launch

    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": conversation(0)}, {"messages": "not a chat"}])
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  path: {chat_model}\ntrain:\n  mode: sft\nsft:\n  train_files: [{data}]\n"
                      f"logging:\n  run_dir: {tmp_path / 'runs'}\n")
    assert launch.main([str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: sft.train_files: '{data}' row 1: ")
    assert not (tmp_path / "runs").exists()


def test_a_conversation_cut_before_any_assistant_token_is_left_out_and_counted(chat_model, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": conversation(0)},
                                             {"messages": [{"role": "user", "content": "x" * 40},
                                                           {"role": "assistant", "content": "y"}]}])
    demos = load_demonstrations([data], "messages", ChatTokenizer(chat_model), 30, "sft.train_files")
    assert len(demos) == 1 and demos.skipped == {"too_long": 1}
    assert demos.items[0].cut  # 'be brief' conversation is 50 characters: cut at 30, still has its first answer


def test_sft_config_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="needs sft.train_files"):
        load_config(None, ["train.mode=sft"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(None, ["train.mode=sft", f"sft.train_files=[{tmp_path}/none.jsonl]"])
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": conversation(0)}])
    with pytest.raises(ConfigError, match="not divisible by learner.world_size"):
        load_config(None, ["train.mode=sft", f"sft.train_files=[{data}]", "sft.batch_size=3", "learner.world_size=2",
                           "train.prompts_per_step=2"])
    assert load_config(None, ["train.mode=sft", f"sft.train_files=[{data}]"]).train.mode == "sft"
    assert np.array_equal(step_indices(3, 3, 0, 0, False), [0, 1, 2])
