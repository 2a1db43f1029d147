"""Every way a data file (RL prompts or SFT demonstrations) can be unreadable is one line naming the
file, and the row and line where there is one."""

from __future__ import annotations

import json
import os

import pytest

from async_rl.config import ConfigError
from async_rl.data import read_rows


def one_line(path) -> str:
    with pytest.raises(ConfigError) as exc:
        read_rows(path)
    line = str(exc.value)
    assert "\n" not in line and f"'{path}'" in line
    return line


@pytest.mark.parametrize(
    ("name", "body", "words"),
    [
        ("empty.jsonl", b"", "has no rows"),
        ("blank.jsonl", b"\n  \n", "has no rows"),
        ("latin1.jsonl", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', "is not UTF-8 text: byte 31 (line 2)"),
        ("bad.jsonl", b'{"prompt": "a"}\n\n{"prompt": \n', "row 1 (line 3) is not JSON"),
        ("list.jsonl", b'{"prompt": "a"}\n[1, 2]\n', "row 1 (line 2) is a list, not an object of columns"),
        ("number.jsonl", b"3\n", "row 0 (line 1) is a int, not an object of columns"),
        ("array.json", b'[{"prompt": "a"}, "b"]', "row 1 is a str, not an object of columns"),
        ("broken.json", b'[{"prompt": "a"},\n {"prompt": ]', "line 2 column 13"),
        ("empty.json", b"[]", "has no rows"),
        ("text.parquet", b"not parquet at all", "cannot be read as parquet"),
        ("long.jsonl", b'{"prompt": "a"}\n{"n": ' + b"1" * 5000 + b"}\n", "row 1 (line 2): ValueError: Exceeds the limit"),
        ("long.json", b'[{"n": ' + b"1" * 5000 + b"}]", "cannot be read as json: ValueError: Exceeds the limit"),
        ("deep.jsonl", b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "row 0 (line 1): RecursionError"),
    ],
)
def test_an_unreadable_file_is_one_line(tmp_path, name, body, words):
    path = tmp_path / name
    path.write_bytes(body)
    assert words in one_line(path)


def test_line_separators_inside_a_string_are_not_line_ends(tmp_path):
    """JSON allows U+2028, U+2029 and U+0085 in a string as they are (json.dumps(ensure_ascii=False)
    writes them so); only "\\n" ends a JSON line."""
    rows = [{"prompt": "a\u2028b\u2029c\u0085d", "answer": "1"}, {"prompt": "e", "answer": "2"}]
    path = tmp_path / "sep.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    assert read_rows(path) == rows


def test_a_truncated_parquet_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"q{i}", "answer": str(i)} for i in range(50)]), path)
    assert len(read_rows(path)) == 50
    path.write_bytes(path.read_bytes()[:-20])
    assert "cannot be read as parquet" in one_line(path)


def test_a_file_gone_or_a_directory(tmp_path):
    assert "does not exist" in one_line(tmp_path / "gone.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    assert "is a directory" in one_line(tmp_path / "dir.jsonl")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_file_not_permitted(tmp_path):
    path = tmp_path / "secret.jsonl"
    path.write_text('{"prompt": "a"}\n')
    path.chmod(0)
    assert "permission denied" in one_line(path)


def test_json_lines_and_arrays_read_alike(tmp_path):
    rows = [{"prompt": "a", "answer": 1, "meta": {"x": [1, 2]}}, {"prompt": "b"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "b.json").write_text(json.dumps(rows))
    (tmp_path / "c.json").write_text("".join(json.dumps(r) + "\n" for r in rows))  # JSON lines named .json
    assert read_rows(tmp_path / "a.jsonl") == read_rows(tmp_path / "b.json") == read_rows(tmp_path / "c.json") == rows
