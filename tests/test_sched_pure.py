"""The scheduler is pure: it imports, plans, verifies and simulates with CUDA, the array
frameworks and MPI made unimportable, and it imports none of them (nor any I/O module)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("cuda", "cupy", "torch", "mpi4py")  # "cuda" covers cuda.bindings

_CHILD = textwrap.dedent("""
    import importlib.abc, json, sys

    BLOCKED = {blocked!r}

    class Unimportable(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is made unimportable by test_sched_pure")
            return None

    sys.meta_path.insert(0, Unimportable())
    for name in BLOCKED:
        sys.modules.pop(name, None)

    import numpy as np
    from hoccl.sched import Options, Shape, build_plan, simulate, verify

    world_size, count = 3, 5
    plan = verify(build_plan(Shape("all_reduce", world_size, count, "int32", 4),
                             Options(chunk_bytes=8)))
    arrays = [{{"send": np.arange(count, dtype=np.int32) * (rank + 1),
                "recv": np.full(count, -1, dtype=np.int32)}} for rank in range(world_size)]
    simulate(plan, arrays, seed=0)
    print(json.dumps({{
        "recv": [a["recv"].tolist() for a in arrays],
        "imported": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED),
    }}))
""").format(blocked=BLOCKED)


def test_scheduler_runs_with_cuda_frameworks_and_mpi_unimportable():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    result = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["imported"] == []
    assert report["recv"] == [[i * (1 + 2 + 3) for i in range(5)]] * 3


# stdlib modules that do I/O or reach outside the process: not for a pure scheduler
_IMPURE_STDLIB = {"os", "io", "socket", "subprocess", "ctypes", "threading",
                  "multiprocessing", "shutil", "tempfile", "pathlib", "logging"}
_ALLOWED_THIRD_PARTY = {"numpy", "ml_dtypes"}
_ALLOWED_HOCCL = {"hoccl.sched", "hoccl._dtypes", "hoccl._errors"}


def _imports(path: Path):
    """``(line, absolute module name)`` of every import in ``path`` (nested ones too)."""
    package = "hoccl.sched"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                yield node.lineno, f"{base}.{node.module}" if node.module else base
            else:
                yield node.lineno, node.module


def test_scheduler_modules_import_only_pure_modules():
    offending = []
    files = sorted((REPO / "hoccl" / "sched").glob("*.py"))
    assert files
    for path in files:
        for line, name in _imports(path):
            root = name.split(".")[0]
            if root == "hoccl":
                allowed = any(name == a or name.startswith(a + ".") for a in _ALLOWED_HOCCL)
            elif root in sys.stdlib_module_names or root == "__future__":
                allowed = root not in _IMPURE_STDLIB
            else:
                allowed = root in _ALLOWED_THIRD_PARTY
            if not allowed:
                offending.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert offending == []
