"""What a benchmark run records and writes: the machine and versions it ran on, its
JSON and Markdown table."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import datetime, timezone
from typing import Any, Dict, List

__all__ = ["metadata", "report"]


def metadata(command: List[str]) -> Dict[str, Any]:
    import torch
    info = {"command": " ".join(command), "date": datetime.now(timezone.utc).isoformat(),
            "host": platform.node(), "python": sys.version.split()[0],
            "torch": torch.__version__, "gpus": torch.cuda.device_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as error:  # report, do not fail the benchmark
        info["nccl"] = f"unknown ({error})"
    try:
        from cuda.bindings import driver
        info["cuda_driver"] = driver.cuDriverGetVersion()[1]
        import cuda.bindings
        info["cuda_bindings"] = cuda.bindings.__version__
    except Exception as error:
        info["cuda_driver"] = f"unknown ({error})"
    try:
        import subprocess
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                         "--format=csv,noheader"], capture_output=True,
                                        text=True, timeout=20).stdout.split()[0]
    except Exception as error:
        info["driver"] = f"unknown ({error})"
    import hoccl
    info["hoccl"] = hoccl.__version__
    return info


def report(result: Dict[str, Any], folder: str, stem: str, text: str,
           echo: bool = True) -> None:
    """Write ``stem``.json and ``stem``.md into ``folder`` (each whole or not at all:
    written beside, then renamed) and print the table unless not ``echo``."""
    os.makedirs(folder, exist_ok=True)
    for suffix, content in ((".json", json.dumps(result, indent=1, default=str)),
                            (".md", text + "\n")):
        path = os.path.join(folder, stem + suffix)
        with open(path + ".part", "w") as handle:
            handle.write(content)
        os.replace(path + ".part", path)
    if echo:
        print(text)
