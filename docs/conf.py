"""Sphinx configuration of hoccl's documentation (MyST Markdown, autodoc, furo).

Build: ``pip install -e '.[docs]' && sphinx-build -W -n --keep-going -b html docs docs/_build/html``.
The API reference imports hoccl; optional dependencies that are not installed (cupy,
torch, mpi4py, cuda-python) are mocked so the build needs no GPU and no extras.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

project = "hoccl"
author = "hoccl contributors"
copyright = "hoccl contributors"
try:
    from importlib.metadata import version as _version
    release = _version("hoccl")
except Exception:  # not installed: the build reads the source tree
    release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "repolinks",
    "hoccl_settings",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = "hoccl"

# Optional dependencies: mock the ones that are missing, never the ones that are present.
_OPTIONAL = ["cupy", "torch", "mpi4py", "cuda", "cuda.bindings", "matplotlib"]
autodoc_mock_imports = [name for name in _OPTIONAL
                        if "." not in name and importlib.util.find_spec(name) is None]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False  # torch's FSDP docstrings are torch's to document
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autosummary_generate = False

# Nitpicky mode checks every reference the docstrings and signatures make. Types of other
# packages are not resolved (no intersphinx: the build must work offline), nor are
# hoccl's private classes that public signatures name.
nitpick_ignore_regex = [
    (r"py:.*", r"(abc|torch|numpy|np|cupy|mpi4py|cuda|datetime|collections|typing|c10d)\b.*"),
    (r"py:.*", r"hoccl\.(\w+\.)*_\w+.*"),
    (r"py:.*", r"hoccl\.bootstrap\.Group"),
]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _code_blocks_as_literals(app, what, name, obj, options, lines: list[str]) -> None:
    """hoccl's docstrings show code as an indented block after a blank line, without
    reST's ``::``.  Mark each such block literal so that it renders as code and its own
    indentation (aligned comments) is kept."""
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        previous = next((text for text in reversed(out) if text.strip()), None)
        starts_block = (line.strip() and out and not out[-1].strip() and previous is not None
                        and _indent(line) > _indent(previous)
                        and not previous.rstrip().endswith("::")
                        and not previous.lstrip().startswith(("- ", "* ", "+ ", ".. ")))
        if starts_block:
            out.extend([" " * _indent(previous) + "::", ""])
            base = _indent(previous)
            while index < len(lines) and (not lines[index].strip() or _indent(lines[index]) > base):
                out.append(lines[index])
                index += 1
            continue
        out.append(line)
        index += 1
    lines[:] = out


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _code_blocks_as_literals)

