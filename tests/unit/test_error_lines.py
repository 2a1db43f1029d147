"""The one-line renderings of an exception that user-facing errors embed (async_rl.errors)."""

from async_rl.errors import first_line, typed_line


def test_first_line_keeps_the_first_line_of_a_long_message_and_cuts_it():
    exc = ValueError("  the template refused the messages\n  File 'x', line 3\n" + "more " * 100)
    assert first_line(exc) == "the template refused the messages"
    assert first_line(ValueError("x" * 300)) == "x" * 200
    assert first_line(ValueError("x" * 300), limit=10) == "x" * 10


def test_an_empty_message_gives_the_type_name():
    assert first_line(KeyError()) == "KeyError"
    assert first_line(RuntimeError("  \n ")) == "RuntimeError"
    assert typed_line(RecursionError()) == "RecursionError"


def test_typed_line_names_the_type_before_the_first_line():
    assert typed_line(ValueError("Exceeds the limit (4300 digits)\nsecond")) == (
        "ValueError: Exceeds the limit (4300 digits)")
