"""torch stays optional: importing hoccl never imports it."""

import subprocess
import sys


def test_importing_hoccl_does_not_import_torch():
    code = ("import sys, hoccl, hoccl.sched, hoccl.testing\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
