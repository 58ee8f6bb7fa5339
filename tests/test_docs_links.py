"""The README's relative links and anchors resolve, and its test command is CI's.

The documentation's own links are checked by its build (``sphinx-build -W -n`` in
``.ci/run``); the README is read on its own (a repository's front page), so its links
are checked here: every relative target exists in the checkout, and every ``#anchor``
names a heading of the Markdown file it points into.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _outside_code(text: str) -> str:
    """The text without fenced code blocks or inline code (links there are not links)."""
    kept, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def _slug(heading: str) -> str:
    """GitHub's (and MyST's) anchor of a Markdown heading."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = "".join(character for character in text
                   if character in " -_" or unicodedata.category(character)[0] in "LN")
    return text.replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _outside_code(markdown.read_text()).splitlines()
            if re.match(r"^#{1,6} ", line)}


def _links(markdown: Path) -> list[str]:
    return [target for target in LINK.findall(_outside_code(markdown.read_text()))
            if "://" not in target and not target.startswith("mailto:")]


def test_slug_matches_github_for_headings_with_symbols() -> None:
    assert _slug("The `init_local` rule") == "the-init_local-rule"
    assert _slug("2 × H200, 2026-12-01 (current)") == "2--h200-2026-12-01-current"
    assert _slug("A rank's own block") == "a-ranks-own-block"


def test_readme_links_resolve() -> None:
    links = _links(README)
    assert links, "the README links into docs/ and results/"
    broken = []
    for target in links:
        path, _, anchor = target.partition("#")
        file = (README.parent / path).resolve() if path else README
        if not file.exists():
            broken.append(f"{target}: {file.relative_to(ROOT)} does not exist")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.name}")
    assert not broken, "README.md has broken links:\n" + "\n".join(broken)


def test_a_planted_broken_link_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[gone](missing.md) [here](#title) [nowhere](#absent)\n"
                    "```\n[in code](ignored.md)\n```\n")
    assert _links(page) == ["missing.md", "#title", "#absent"]
    assert "title" in _anchors(page) and "absent" not in _anchors(page)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    commands = [line for line in README.read_text().splitlines()
                if line.startswith("python3 -m venv .venv") and "pytest" in line]
    assert len(commands) == 1, "the README shows one test command"
    ci = ROOT / ".ci" / "run"
    if not ci.exists():
        pytest.skip("no .ci/run in this checkout")
    assert commands[0] in ci.read_text().splitlines()
