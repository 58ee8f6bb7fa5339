"""Deprecated: the one-GPU lever study moved out of the package to ``benchmarks/levers.py``
in hoccl's source tree (``python benchmarks/levers.py``).  ``python -m hoccl.bench.levers``
still runs it from a source checkout, with a deprecation warning, for one release."""

import runpy
import sys
import warnings
from pathlib import Path

__all__: list = []

STUDY = Path(__file__).resolve().parents[2] / "benchmarks" / "levers.py"


def main() -> None:
    warnings.warn("python -m hoccl.bench.levers is deprecated: run python benchmarks/levers.py "
                  "from hoccl's source tree", DeprecationWarning, stacklevel=2)
    if not STUDY.is_file():
        sys.exit("python -m hoccl.bench.levers: the lever study is not installed with hoccl; "
                 "run python benchmarks/levers.py from hoccl's source tree")
    sys.argv[0] = str(STUDY)
    runpy.run_path(str(STUDY), run_name="__main__")


if __name__ == "__main__":
    main()
