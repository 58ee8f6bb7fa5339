"""hoccl's modules import one way: no module imports (at its top or inside a function;
annotations under ``TYPE_CHECKING`` aside) one that imports it back, directly or through
others."""

import ast
from pathlib import Path

import hoccl

ROOT = Path(hoccl.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str) -> set:
    """The hoccl modules ``path`` imports, anywhere in it (package ``__init__`` modules
    count as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(child) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for statement in node.body for child in ast.walk(statement)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: no import at run time
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("hoccl")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("hoccl"):
                found.add(module)
                # ``from . import _build``: the submodule itself
                found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def test_no_module_imports_one_that_imports_it_back():
    modules = {_module_name(path): path for path in ROOT.rglob("*.py")}
    graph = {name: {target for target in _imports(path, name) if target in modules
                    and target != name} for name, path in modules.items()}
    # a package's __init__ re-exports its submodules: an edge into the package from one
    # of its own submodules is the submodule reaching its siblings, not a cycle
    for name in graph:
        graph[name] = {target for target in graph[name]
                       if not (name.startswith(target + ".") and modules[target].name == "__init__.py")}
    state: dict = {}
    cycles = []

    def visit(node, trail):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(trail[trail.index(target):] + [target])
            elif target not in state:
                visit(target, trail + [target])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles[:10])
