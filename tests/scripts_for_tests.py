"""Running the experiment scripts as a user would: ``python experiments/<script>`` in a fresh
interpreter, on the CPU, with this repository importable; or importing one, to test its
functions."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def users_env(env: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``env`` (default ``os.environ``) and ``extra``, without the quick XLA flags that
    ``conftest.py`` set for the tests' own processes: a command, notebook kernel or docs build
    started with it compiles under the flags its user gets (the project's rule,
    :mod:`svflow_jax.xla_settings`). A user's own ``XLA_FLAGS`` are kept.

    For work whose run time outweighs its compile time: SmolLM2's ``svflow inspect --quick``
    took 41 s under XLA's defaults on an empty compilation cache, 91 s under the quick flags
    with every program cached (idle 2-core CPU); the seven notebooks 183 s and 188 s."""
    env = dict(os.environ if env is None else env, **extra)
    ours = env.pop("SVFLOW_TESTS_SET_XLA_FLAGS", None)
    if ours is not None and env.get("XLA_FLAGS") == ours:
        del env["XLA_FLAGS"]
    return env


def import_script(name: str):
    """``experiments/<name>`` imported as a module (once per process), for tests of its
    functions."""
    module_name = "experiments_" + Path(name).stem
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, ROOT / "experiments" / name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


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
