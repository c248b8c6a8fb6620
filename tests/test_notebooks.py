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

Wall times are printed (and recorded as a junit property), never asserted.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jupytext
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.py"))
EXECUTABLE_TAG = "kernel-executable:"


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 4, f"expected the four teaching notebooks, found {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path, capsys, record_property):
    nb = jupytext.read(path)
    probe = nbformat.v4.new_code_cell(f"import sys; print({EXECUTABLE_TAG!r}, sys.executable)")
    nb.cells.insert(0, probe)

    kernel_manager = AsyncKernelManager(
        kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[])
    )
    client = NotebookClient(
        nb, km=kernel_manager, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start

    printed = "".join(out.get("text", "") for out in nb.cells[0].outputs)
    assert EXECUTABLE_TAG in printed, printed
    kernel_python = printed.split(EXECUTABLE_TAG, 1)[1].strip()
    assert os.path.realpath(kernel_python) == os.path.realpath(sys.executable), (
        f"the notebook kernel ran {kernel_python}, not this interpreter {sys.executable}"
    )
    last = [cell for cell in nb.cells if cell.cell_type == "code"][-1]
    final = "".join(out.get("text", "") for out in last.outputs)
    assert "all checks passed" in final, "the notebook must end with its checks cell"

    record_property("wall_time_s", round(seconds, 1))
    with capsys.disabled():
        print(f"\n[notebook] {path.name}: {seconds:.1f} s")
