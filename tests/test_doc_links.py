"""Every relative link of README.md and docs/*.md resolves: the file exists and a ``#anchor`` names a heading of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")
_INLINE = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target)
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)(?:\s+[\"'(].*)?$", flags=re.MULTILINE)  # [label]: target


def links(text: str) -> list[str]:
    """Link targets of a Markdown text, code blocks and code spans left out (what they show is not a link)."""
    text = _CODE.sub("", _FENCE.sub("", text))
    return [m.group(1) for m in (*_INLINE.finditer(text), *_REFERENCE.finditer(text))]


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings: lower case, punctuation dropped, spaces to ``-``, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", text).splitlines():
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken(doc: Path) -> list[str]:
    """The relative links of ``doc`` that do not resolve, each with why."""
    found = []
    for target in links(doc.read_text()):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto: ... are not checked here
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            found.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            found.append(f"{target}: no heading #{anchor} in {file.name}")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    assert broken(doc) == []


def test_the_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "there.md").write_text("# A `code` heading, with punctuation!\n\n## Twice\n\n## Twice\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md#a-code-heading-with-punctuation) [ok](there.md#twice-1) [ok](#local) ![img](there.md)\n"
        "[gone](missing.md) [bad](there.md#nowhere) [web](https://example.com/x.md) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n\n# Local\n\n[ref]: also_missing.md\n"
    )
    assert broken(doc) == [
        "missing.md: no such file",
        "there.md#nowhere: no heading #nowhere in there.md",
        "also_missing.md: no such file",
    ]
