"""Running the experiment scripts as a user would: ``python experiments/<script>`` in a fresh
interpreter, on the CPU, with this repository importable."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python experiments/<name> args...``; stdout and stderr captured as text."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(ROOT / "experiments" / name), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_refused(proc: subprocess.CompletedProcess, named: str, out: Path) -> None:
    """A bad option: exit code 2, ``named`` in the message, and nothing written to ``out``."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr
    assert not out.exists()
