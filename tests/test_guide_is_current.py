"""The user guide and the package's docstrings say what is true now.

Commit ids, the word "session" and dated stories of a fix ("found wrong on 2026-12-02,
fixed …") are history: they belong in the results index (``docs/results.md`` and the run
pages under ``docs/results/``) and in ``docs/design-notes.md``. Every other page under
``docs/``, the README, and every docstring and comment under ``hoccl/`` is checked here.
Link targets are not prose: a page may link to a run's folder of raw data.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
HISTORY_PAGES = {"results.md", "design-notes.md"}

#: 7 to 40 hexadecimal characters with at least one digit and one letter: a commit id
#: (``0x`` constants, words and plain numbers are not)
COMMIT = re.compile(r"(?<![0-9A-Za-z_/.#-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}"
                    r"(?![0-9A-Za-z_])")
SESSION = re.compile(r"\bsessions?\b", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
#: words that make a dated sentence a story of a change rather than a run's date
STORY = re.compile(r"\b(found|fixed|wrong|broken|broke|regress\w*|since|until|no longer)\b",
                   re.IGNORECASE)
LINK_TARGET = re.compile(r"\]\([^)]*\)")


def guide_pages() -> List[Path]:
    pages = [ROOT / "README.md"]
    pages += sorted(page for page in (ROOT / "docs").glob("*.md")
                    if page.name not in HISTORY_PAGES)
    return pages


def history_found(text: str) -> List[str]:
    """What in ``text`` reads as history: commit ids, "session", dated fix stories."""
    text = LINK_TARGET.sub("]", text)
    found = [f"commit id {match.group()!r}" for match in COMMIT.finditer(text)]
    found += [f"{match.group()!r}" for match in SESSION.finditer(text)]
    for sentence in re.split(r"(?<=[.;:!?])\s+|\n\s*\n", text):
        if DATE.search(sentence) and STORY.search(sentence):
            found.append(f"a dated story: {' '.join(sentence.split())[:120]!r}")
    return found


def page_findings(page: Path) -> Iterator[Tuple[str, str]]:
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for what in history_found(line):
            yield f"{page.relative_to(ROOT)}:{number}", what
    # a dated story may span lines: check each paragraph as a whole as well
    for paragraph in re.split(r"\n\s*\n", page.read_text()):
        joined = " ".join(paragraph.split())
        if DATE.search(joined) and not any(DATE.search(line) and STORY.search(line)
                                           for line in paragraph.splitlines()):
            for sentence in re.split(r"(?<=[.;:!?])\s+", joined):
                if DATE.search(sentence) and STORY.search(sentence):
                    yield f"{page.relative_to(ROOT)}", f"a dated story: {sentence[:120]!r}"


def source_texts(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, text) of every docstring and comment of a Python file."""
    source = path.read_text()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                line = node.body[0].lineno if not isinstance(node, ast.Module) else 1
                yield line, docstring
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def source_findings(path: Path, root: Path = ROOT) -> Iterator[Tuple[str, str]]:
    for line, text in source_texts(path):
        for what in history_found(text):
            yield f"{path.relative_to(root)}:{line}", what


def test_the_guide_pages_hold_no_history() -> None:
    found = [f"{where}: {what}" for page in guide_pages() for where, what in page_findings(page)]
    assert not found, ("history in the guide (move it to docs/results.md or "
                       "docs/design-notes.md):\n" + "\n".join(found))


def test_the_package_docstrings_and_comments_hold_no_history() -> None:
    found = [f"{where}: {what}" for path in sorted((ROOT / "hoccl").rglob("*.py"))
             for where, what in source_findings(path)]
    assert not found, ("history in hoccl/'s docstrings or comments:\n" + "\n".join(found))


def test_the_sidebar_names_no_session() -> None:
    """Every page's title is in the site's sidebar, the run pages' too."""
    titles = [page.read_text().splitlines()[0]
              for page in sorted((ROOT / "docs").rglob("*.md")) if "_build" not in page.parts]
    assert titles and not [title for title in titles if SESSION.search(title)], titles


@pytest.mark.parametrize("text", [
    "measured at commit a189fd4 (4 MiB stages)",
    "the full id 8e34d01c5b2a9f0e7d6c4b3a29180f7e6d5c4b3a",
    "(session 7: all ran on the H200)",
    "Sessions 5–12 ran on one GPU.",
    "Found wrong on the H200 (2026-12-02), fixed, right on the H200 since (2026-12-03).",
])
def test_each_kind_of_history_is_found(text: str) -> None:
    assert history_found(text), text


@pytest.mark.parametrize("text", [
    "the poison value 0x7fc00001 and the word deadbeef",
    "5732 passed, 129 skipped in 626.52s",
    "2 × H200 run of 2026-12-01: 1.022× NCCL's tokens/s",
    "[data](../results/h200/session19/README.md)",
    "decade facade accede",
])
def test_current_facts_are_not_taken_for_history(text: str) -> None:
    assert not history_found(text), history_found(text)


def test_a_planted_commit_in_a_docstring_is_found(tmp_path: Path) -> None:
    module = tmp_path / "planted.py"
    module.write_text('"""Module."""\n\ndef f():\n    """Faster since 4c04837."""\n'
                      "    return 1  # measured in session 12\n")
    found = list(source_findings(module, tmp_path))
    assert [where for where, _ in found] == ["planted.py:4", "planted.py:5"], found
