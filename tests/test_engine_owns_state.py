"""The Engine owns its state: no module but the Engine's own (``hoccl/_engine/engine.py``
and its issue stage, ``issue.py``) assigns an attribute of an engine (``engine.x = ...``,
``self._engine.x += ...``, ``setattr(engine, ...)``); groups, health, the builder, the
Communicator and the preparer change it through its methods."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: the modules of the Engine class itself
ENGINE = {REPO / "hoccl" / "_engine" / "engine.py", REPO / "hoccl" / "_engine" / "issue.py"}
#: the names an engine goes by outside its package
NAMES = {"engine", "_engine"}
#: where ``engine`` names another kind of engine (the engines across hosts): only a
#: communicator's ``_engine`` is the Engine there
OTHER_ENGINES = REPO / "hoccl" / "_hierarchy"


def _packages():
    return sorted(path for path in REPO.iterdir()
                  if path.is_dir() and (path / "__init__.py").exists() and path.name != "tests")


def _is_engine(node: ast.AST, names=NAMES) -> bool:
    return ((isinstance(node, ast.Name) and node.id in names)
            or (isinstance(node, ast.Attribute) and node.attr in names))


def _targets(node: ast.AST):
    if isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _targets(element)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def engine_writes(source: str, names=NAMES) -> list:
    """Each ``engine.attribute`` that ``source`` assigns, as written (``names``: what an
    engine goes by)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr") and node.args
              and _is_engine(node.args[0], names)):
            found.append(ast.unparse(node))
            continue
        elif isinstance(node, ast.Delete):
            targets = node.targets
        else:
            continue
        for target in targets:
            for leaf in _targets(target):
                if isinstance(leaf, ast.Attribute) and _is_engine(leaf.value, names):
                    found.append(ast.unparse(leaf))
    return found


def _modules():
    return [path for package in _packages() for path in sorted(package.rglob("*.py"))
            if path not in ENGINE]


@pytest.mark.parametrize("path", _modules(), ids=lambda path: str(path.relative_to(REPO)))
def test_no_module_outside_the_engine_assigns_its_attributes(path):
    names = {"_engine"} if OTHER_ENGINES in path.parents else NAMES
    assert engine_writes(path.read_text(), names) == []


def test_the_scan_finds_every_kind_of_write():
    source = ("engine.closed = True\n"
              "self._engine.calls += 1\n"
              "error, member.engine.pending_error = None, None\n"
              "setattr(engine, 'aborted', True)\n"
              "engine.windows.add(1)\n"          # a method: not a write
              "x = engine.closed\n")
    assert engine_writes(source) == ["engine.closed", "self._engine.calls",
                                     "member.engine.pending_error",
                                     "setattr(engine, 'aborted', True)"]
