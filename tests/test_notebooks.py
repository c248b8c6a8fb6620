"""Every teaching notebook runs top to bottom and passes its own final assertions.

The notebooks are kept as jupytext percent-format ``.py`` files in ``notebooks/``. Each is
converted with ``jupytext.read`` and executed by ``nbclient`` in a fresh kernel whose working
directory is a temporary folder (nothing is written into the repository). A notebook fails the
test on the first cell that raises, which includes its closing ``assert`` cell; that last cell
must also print ``all checks passed``.

The kernel is the ``python3`` kernel of *this* interpreter: we give ``nbclient`` a kernel
manager whose spec manager searches no kernel directories, so ``python3`` can only resolve to
ipykernel's built-in spec, which launches ``sys.executable`` (a ``python3`` kernelspec installed
for the user or system, pointing at another Python, cannot be picked up). A first cell injected
into the in-memory notebook prints the kernel's ``sys.executable`` and the test checks it.

Execution is shared with the documentation site (``docs/_build_tools/notebook_cache.py``): the
executed notebook is saved to ``build/notebooks/`` for the site, and a notebook the docs build
(``tests/test_docs.py``) already executed *during this same test run*, with the same sources, is
checked from that execution instead of being run a second time. Outputs of an earlier run are
never reused here.

Every kernel is shut down when its notebook ends (passed or raised): no ``ipykernel_launcher``
child of the test process survives an execution (read from ``/proc``, so checked on Linux).

Wall times are printed (and recorded as a junit property), never asserted.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from pathlib import Path

import pytest
from scripts_for_tests import users_env

ROOT = Path(__file__).resolve().parent.parent


def _load_notebook_cache():
    """``docs/_build_tools/notebook_cache.py``, imported once per process."""
    name = "svflow_docs_notebook_cache"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, ROOT / "docs" / "_build_tools" / "notebook_cache.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


notebook_cache = _load_notebook_cache()
# One id per test run, shared by every xdist worker (and by the docs build they start).
RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID") or os.environ.setdefault(
    "SVFLOW_PYTEST_RUN_ID", uuid.uuid4().hex)
NOTEBOOKS = notebook_cache.notebooks()


def kernel_children() -> list[int]:
    """Process ids of the live ``ipykernel_launcher`` processes whose parent is this process."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state != "Z" and b"ipykernel_launcher" in cmdline:
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


linux_only = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="reads processes from /proc (Linux)")


@linux_only
@pytest.mark.parametrize("fails", [False, True], ids=["passes", "raises"])
def test_execute_shuts_its_kernel_down(tmp_path, fails):
    """The kernel that ran the notebook was this process's child and is gone afterwards."""
    source = tmp_path / "tiny.py"
    source.write_text("# %%\nimport os\nprint('kernel', os.getpid(), os.getppid())\n"
                      + ("# %%\nraise RuntimeError('cell failed on purpose')\n" if fails
                         else ""))
    before = kernel_children()
    if fails:
        from nbclient.exceptions import CellExecutionError

        with pytest.raises(CellExecutionError, match="cell failed on purpose"):
            notebook_cache.execute(source)
    else:
        nb, _ = notebook_cache.execute(source)
        printed = "".join(out.get("text", "") for out in nb.cells[1].outputs).split()
        pid, parent = int(printed[1]), int(printed[2])
        assert parent == os.getpid(), "the kernel was not a child of this process"
        assert not alive(pid), f"kernel {pid} outlived its notebook"
    assert kernel_children() == before == []


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 4, f"expected the four teaching notebooks, found {NOTEBOOKS}"


# Each notebook is an xdist group of its own (conftest.py), handed out before the docs build
# and in reverse order: the longest (a real model) first, so that the two workers share them.
@pytest.mark.parametrize("path", NOTEBOOKS[::-1], ids=[p.stem for p in NOTEBOOKS[::-1]])
def test_notebook_runs(path: Path, capsys, record_property, monkeypatch):
    if "XLA_FLAGS" not in users_env():  # the kernel compiles as in a reader's Jupyter
        monkeypatch.delenv("XLA_FLAGS")
    nb, info = notebook_cache.executed(path, reuse="run", run_id=RUN_ID)
    if Path("/proc/self/stat").exists():
        assert kernel_children() == [], "a notebook kernel outlived its execution"

    probe = nb.cells[0]
    printed = "".join(out.get("text", "") for out in probe.outputs)
    tag = notebook_cache.EXECUTABLE_TAG
    assert tag in printed, printed
    kernel_python = printed.split(tag, 1)[1].strip()
    assert os.path.realpath(kernel_python) == os.path.realpath(sys.executable), (
        f"the notebook kernel ran {kernel_python}, not this interpreter {sys.executable}"
    )
    last = [cell for cell in nb.cells if cell.cell_type == "code"][-1]
    final = "".join(out.get("text", "") for out in last.outputs)
    assert "all checks passed" in final, "the notebook must end with its checks cell"

    record_property("wall_time_s", info["seconds"])
    how = " (executed by the docs build in this run)" if info["reused"] else ""
    with capsys.disabled():
        print(f"\n[notebook] {path.name}: {info['seconds']:.1f} s{how}")
