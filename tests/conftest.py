"""Test configuration: float64, quick XLA flags, a persistent compilation cache, and how the
tests are spread over the xdist workers.

``jax_enable_x64`` must be set before any JAX array exists, so it is done here, at import time
of the conftest, before any test module is collected. Float32 paths are exercised by asking for
``jnp.float32`` explicitly, with the tolerances stated in each test.

The tests' problems are small, so their time is mostly XLA compilation:

* they run under the project's quick-run XLA flags (``svflow_jax.xla_settings.QUICK_FLAGS``:
  LLVM optimisations off, the older fusion emitters), set here before JAX starts its CPU
  client. A ``XLA_FLAGS`` in the environment wins (``XLA_FLAGS= python -m pytest`` for XLA's
  defaults);
* every program is kept in JAX's persistent compilation cache, ``$SVFLOW_TEST_JAX_CACHE``, else
  ``~/.cache/svflow-jax/test-xla`` (an empty ``SVFLOW_TEST_JAX_CACHE`` turns it off). It is set
  through the environment (``JAX_COMPILATION_CACHE_DIR``, the two thresholds at 0, at most
  2 GiB: least recently used programs go first), so the xdist workers, the scripts and
  commands the tests start, the notebook kernels and the docs build all share it. A
  ``JAX_COMPILATION_CACHE_DIR`` already in the environment wins. A cached program is the
  program XLA would compile (the key covers the computation, the flags, the backend and the
  versions), so results do not depend on it; tests about the cache itself pass their own
  empty folder (``--cache-dir``).

Distribution over workers (``--dist loadgroup``, pyproject's ``addopts``): the tests of one file
stay on one worker (module fixtures are built once), except that every notebook is a group of
its own (executing them is a fifth of the suite's time) and the tests that load SmolLM2 form one
group, so that the session fixture :func:`smollm2` reads the checkpoint once. The groups known
to be long (:data:`LONG_FIRST`) are handed out first.

With ``$SVFLOW_TEST_ARTIFACTS`` set (CI sets ``.ci/artifacts``), the controller writes
``durations.tsv`` there: every test's setup + call + teardown seconds, and each file's total.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

from svflow_jax.xla_settings import QUICK_FLAGS

os.environ.setdefault("XLA_FLAGS", QUICK_FLAGS)

_cache = os.environ.get("SVFLOW_TEST_JAX_CACHE",
                        str(Path.home() / ".cache" / "svflow-jax" / "test-xla"))
if _cache and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 * 1024**3))  # LRU beyond

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct in float32, read once per worker (its tests share one group)."""
    import jax.numpy as jnp
    from models_for_tests import fetch_or_skip

    from svflow_jax import checkpoints

    return checkpoints.load(fetch_or_skip(SMOLLM2), dtype=jnp.float32)


def _group(item: pytest.Item) -> str:
    if "smollm2" in item.fixturenames or "smollm2" in item.originalname:
        return "smollm2"
    if item.originalname == "test_notebook_runs":
        return f"notebook-{item.callspec.id}"
    return item.path.name


# Groups that take longest go first, so that no worker is left with a long group while the
# other waits at the end (xdist hands out groups in collection order); the rest keep theirs.
LONG_FIRST = ("smollm2", "test_docs.py", "notebook-", "test_solvers.py", "test_transformer.py",
              "test_claims.py", "test_vmf.py", "test_checkpoints.py")


def _rank(group: str) -> int:
    return next((k for k, g in enumerate(LONG_FIRST) if group.startswith(g)), len(LONG_FIRST))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks every test with its xdist group (see the module docstring), before xdist reads
    the marks, and puts the long groups first (a stable sort: the order within a file stays)."""
    for item in items:
        if not any(True for _ in item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    items.sort(key=lambda item: _rank(next(item.iter_markers("xdist_group")).args[0]))


_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid.split("@")[0]] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = os.environ.get("SVFLOW_TEST_ARTIFACTS")
    if not folder or hasattr(session.config, "workerinput") or not _seconds:
        return
    by_file: dict[str, float] = defaultdict(float)
    for nodeid, seconds in _seconds.items():
        by_file[nodeid.split("::")[0]] += seconds
    lines = ["seconds\ttest"]
    lines += [f"{s:.2f}\t{n}" for n, s in sorted(_seconds.items(), key=lambda kv: -kv[1])]
    lines += ["", "seconds\tfile"]
    lines += [f"{s:.2f}\t{n}" for n, s in sorted(by_file.items(), key=lambda kv: -kv[1])]
    lines += ["", f"{sum(_seconds.values()):.2f}\ttotal"]
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "durations.tsv").write_text("\n".join(lines) + "\n")
