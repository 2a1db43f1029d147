"""Every relative link in README.md, docs/*.md and benchmarks/README.md points to a file that exists
(and, for a `#anchor` into a Markdown file, to a heading it has, slugged as GitHub does); every docs
page is one click from the README."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
INLINE_CODE = re.compile(r"`+[^`\n]*?`+")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """The text links can live in: no fenced code, no HTML comments."""
    return COMMENT.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    body = INLINE_CODE.sub("", prose(text))
    return LINK.findall(body) + REF_DEF.findall(body)


def slug(heading: str) -> str:
    """GitHub's heading anchor: markup dropped, lower case, punctuation but '-' and '_' removed,
    spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(prose(path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in links(page.read_text()):
        if SCHEME.match(target) or target.startswith("//"):
            continue  # a URL, not a file of this repository
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.exists():
            bad.append(f"{target}: no such file {_shown(dest)}")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            bad.append(f"{target}: no heading '#{anchor}' in {_shown(dest)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert page.exists()
    assert broken_links(page) == []


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in links(readme.read_text()) if not SCHEME.match(t)}
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "no docs pages"
    assert [p.name for p in pages if p.resolve() not in linked] == []


def test_the_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading, with `code`\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading-with-code) [ok](there.md#twice-1) [ok](#local)\n"
        "[url](https://example.com/x) `[in code](missing.md)`\n"
        "```\n[in a fence](missing.md)\n```\n<!-- [in a comment](missing.md) -->\n"
        "# Local\n[bad](missing.md) [bad](there.md#nowhere) ![bad](img/none.png)\n"
    )
    assert broken_links(page) == [
        f"missing.md: no such file {tmp_path / 'missing.md'}",
        "there.md#nowhere: no heading '#nowhere' in " + str(tmp_path / "there.md"),
        f"img/none.png: no such file {tmp_path / 'img' / 'none.png'}",
    ]
