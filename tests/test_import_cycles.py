"""The repository's modules import one way: no module imports one that imports it back,
directly or through others.  Every import counts: at a module's top, inside a function,
and under ``TYPE_CHECKING`` (an annotation names what its module depends on); every
package of the repository is scanned (each directory at its root with an
``__init__.py``), and imports between them count too."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def packages(root: Path = REPO) -> list:
    """The repository's packages: the directories at its root with an ``__init__.py``."""
    return sorted(path for path in root.iterdir()
                  if path.is_dir() and (path / "__init__.py").exists())


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str) -> set:
    """The modules ``path`` imports, anywhere in it, typing-only imports included
    (package ``__init__`` modules count as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            # ``from . import _build``: the submodule itself
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def import_graph(root: Path = REPO) -> dict:
    """Module name -> the modules of the repository's packages it imports."""
    modules = {_module_name(path, root): path for package in packages(root)
               for path in package.rglob("*.py")}
    graph = {name: {target for target in _imports(path, name) if target in modules
                    and target != name} for name, path in modules.items()}
    # a package's __init__ re-exports its submodules: an edge into the package from one
    # of its own submodules is the submodule reaching its siblings, not a cycle
    for name in graph:
        graph[name] = {target for target in graph[name]
                       if not (name.startswith(target + ".") and modules[target].name == "__init__.py")}
    return graph


def cycles(graph: dict) -> list:
    """Some import cycles of ``graph`` (none if it has none), each as a closed path."""
    state: dict = {}
    found = []

    def visit(node, trail):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(trail[trail.index(target):] + [target])
            elif target not in state:
                visit(target, trail + [target])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


def test_every_package_of_the_repository_is_scanned():
    names = [path.name for path in packages()]
    assert "hoccl" in names and "hoccl_autoload" in names


def test_no_module_imports_one_that_imports_it_back():
    found = cycles(import_graph())
    assert not found, "\n".join(" -> ".join(cycle) for cycle in found[:10])


def test_typing_only_and_cross_package_imports_count(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    (tmp_path / "one" / "__init__.py").write_text("from typing import TYPE_CHECKING\n"
                                                  "if TYPE_CHECKING:\n"
                                                  "    from two import thing\n")
    (tmp_path / "two" / "__init__.py").write_text("def thing():\n"
                                                  "    import one\n")
    assert cycles(import_graph(tmp_path)) == [["one", "two", "one"]]
