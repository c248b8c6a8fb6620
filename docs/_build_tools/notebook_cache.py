"""Execute each teaching notebook once and share the executed copy between the tests and the site.

``tests/test_notebooks.py`` and the documentation build (``docs/_build_tools/hooks.py``) both
need every ``notebooks/*.py`` executed; executing them twice would double the few minutes they
take in CI. Both go through :func:`executed`, which keeps the executed ``.ipynb`` in
``build/notebooks/`` (git-ignored; ``$SVFLOW_NOTEBOOK_CACHE`` overrides it) under a per-notebook
file lock:

* the **cache key** is a SHA-256 of the notebook's source, every ``.py`` file of ``svflow_jax/``,
  the interpreter and the versions of the libraries that shape the outputs; a notebook whose
  key changed is executed again;
* the **run id** names who executed it: the tests pass ``reuse="run"`` with their test run's id
  (``$PYTEST_XDIST_TESTRUNUID``, shared by all xdist workers), so a test reuses a notebook only
  when the docs build executed it *during the same test run*; a test never passes from a
  previous run's outputs. The docs build passes ``reuse="key"``: any copy with the current key
  will do (a second local build executes nothing).

Whoever comes first executes; the other waits on the lock and reads the result, so in one CI
run every notebook is executed exactly once, whichever of the two test files the scheduler
starts first. Execution is ``nbclient`` in a fresh ``python3`` kernel of *this* interpreter,
in a temporary working directory (nothing is written into the repository); a first, tagged
cell prints the kernel's ``sys.executable`` (the test checks it; the site removes the cell).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = ROOT / "notebooks"
EXECUTABLE_TAG = "kernel-executable:"
PROBE_CELL_TAG = "remove_cell"  # nbconvert's TagRemovePreprocessor drops it from the site
RUN_ID_ENV = "SVFLOW_TEST_RUN_ID"
TIMEOUT_S = 600
_VERSIONED = ("jax", "jaxlib", "numpy", "matplotlib", "diffrax", "equinox", "flax", "optax",
              "scipy", "ipykernel", "nbclient", "jupytext")


def cache_dir() -> Path:
    """``$SVFLOW_NOTEBOOK_CACHE``, else ``build/notebooks/`` in the repository."""
    return Path(os.environ.get("SVFLOW_NOTEBOOK_CACHE") or ROOT / "build" / "notebooks")


def notebooks() -> list[Path]:
    """Every ``notebooks/*.py`` (jupytext percent format), sorted by name."""
    return sorted(NOTEBOOKS_DIR.glob("*.py"))


def cache_key(path: Path) -> str:
    """SHA-256 of what a notebook's outputs depend on (see the module docstring)."""
    digest = hashlib.sha256()
    digest.update(Path(path).read_bytes())
    for source in sorted((ROOT / "svflow_jax").rglob("*.py")):
        digest.update(str(source.relative_to(ROOT)).encode())
        digest.update(source.read_bytes())
    digest.update(os.path.realpath(sys.executable).encode())
    for name in _VERSIONED:
        try:
            digest.update(f"{name}=={importlib.metadata.version(name)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{name} absent".encode())
    return digest.hexdigest()


def kernel_manager_class():
    """``AsyncKernelManager`` whose spec manager searches no kernel directories: ``python3``
    can only resolve to ipykernel's built-in spec, which launches ``sys.executable`` (a
    ``python3`` kernelspec installed for the user or system, pointing at another Python, cannot
    be picked up)."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class ThisInterpreterKernelManager(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _kernel_spec_manager_default(self) -> KernelSpecManager:
            return KernelSpecManager(kernel_dirs=[])

    return ThisInterpreterKernelManager


def execute(path: Path):
    """Runs the notebook top to bottom in a fresh kernel; returns ``(notebook, seconds)``.

    ``nbclient`` creates the kernel manager itself (``kernel_manager_class``), so it owns the
    kernel and shuts it down when execution ends, whether the cells passed or raised: no
    ``ipykernel_launcher`` process outlives this call. (Handing ``NotebookClient`` a kernel
    manager of our own would leave the kernel running until this process exits.)

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised (the message names it).
    """
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    nb = jupytext.read(path)
    probe = nbformat.v4.new_code_cell(f"import sys; print({EXECUTABLE_TAG!r}, sys.executable)")
    probe.metadata["tags"] = [PROBE_CELL_TAG]
    nb.cells.insert(0, probe)
    with tempfile.TemporaryDirectory(prefix=f"svflow-{path.stem}-") as workdir:
        client = NotebookClient(nb, kernel_manager_class=kernel_manager_class(),
                                timeout=TIMEOUT_S, kernel_name="python3",
                                resources={"metadata": {"path": workdir}})
        start = time.perf_counter()
        client.execute()
        seconds = time.perf_counter() - start
    return nb, seconds


@contextlib.contextmanager
def _locked(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock (at worst a notebook runs twice)
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def executed(path: Path, reuse: str = "key", run_id: str | None = None):
    """The executed notebook, from the cache when allowed, else executed now and cached.

    Args:
        path: a ``notebooks/*.py`` file.
        reuse: ``"key"``: reuse a cached copy whose cache key matches; ``"run"``: reuse it only
            if it was also executed during the run ``run_id``; ``"never"``: always execute.
        run_id: recorded with a fresh execution, and matched under ``reuse="run"``; default
            ``$SVFLOW_TEST_RUN_ID`` (unset outside the tests).

    Returns:
        ``(notebook, info)``: the executed ``nbformat`` notebook (its first cell the tagged
        probe) and a dict ``{"seconds", "reused", "run_id", "key"}``.

    Raises:
        ValueError: an unknown ``reuse``.
        nbclient.exceptions.CellExecutionError: a cell raised (nothing is cached then).
    """
    import nbformat

    if reuse not in ("key", "run", "never"):
        raise ValueError(f"reuse must be 'key', 'run' or 'never', got {reuse!r}")
    path = Path(path)
    run_id = run_id if run_id is not None else os.environ.get(RUN_ID_ENV)
    target = cache_dir() / f"{path.stem}.ipynb"
    key = cache_key(path)
    with _locked(cache_dir() / f"{path.stem}.lock"):
        if reuse != "never" and target.exists():
            nb = nbformat.read(target, as_version=4)
            meta = nb.metadata.get("svflow_cache", {})
            if meta.get("key") == key and (reuse == "key" or (run_id and meta.get("run_id")
                                                              == run_id)):
                return nb, {**meta, "reused": True}
        nb, seconds = execute(path)
        meta = {"key": key, "run_id": run_id, "seconds": round(seconds, 2)}
        nb.metadata["svflow_cache"] = meta
        partial = target.with_suffix(".ipynb.partial")
        nbformat.write(nb, partial)
        os.replace(partial, target)
        return nb, {**meta, "reused": False}
