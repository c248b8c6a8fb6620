"""Test configuration: float64, quick XLA flags, a persistent compilation cache, and how the
tests are spread over the xdist workers.

``jax_enable_x64`` must be set before any JAX array exists, so it is done here, at import time
of the conftest, before any test module is collected. Float32 paths are exercised by asking for
``jnp.float32`` explicitly, with the tolerances stated in each test.

The tests' problems are small, so their time is mostly XLA compilation:

* they run under the project's quick-run XLA flags (``svflow_jax.xla_settings.QUICK_FLAGS``:
  LLVM optimisations off, the older fusion emitters), set here before JAX starts its CPU
  client, and only when the backend is the CPU (``svflow_jax.xla_settings.project_flags``). A
  ``XLA_FLAGS`` in the environment wins (``XLA_FLAGS= python -m pytest`` for XLA's defaults);
* every program is kept in JAX's persistent compilation cache, ``$SVFLOW_TEST_JAX_CACHE``, else
  ``~/.cache/svflow-jax/test-xla`` (an empty ``SVFLOW_TEST_JAX_CACHE`` turns it off). It is set
  through the environment (``JAX_COMPILATION_CACHE_DIR``, the two thresholds at 0, and
  ``SVFLOW_CACHE_DIR``, the folder the ``svflow`` commands open), so the xdist workers, the
  scripts and commands the tests start, the notebook kernels and the docs build all share it.
  Its size is bounded once per test run, at the start, by
  :func:`svflow_jax.xla_settings.prune_cache` (at most 2 GiB, the programs used longest ago go
  first), and not by jax:
  jax's bound (``jax_compilation_cache_max_size``) lists and reads the whole folder each time it
  writes a program, under a lock every process waits on (0.3-0.6 s per program at 8500
  programs; a run on an empty cache writes thousands). A
  ``JAX_COMPILATION_CACHE_DIR`` already in the environment wins. jax reads these variables
  when it is first imported, which can come before this file sets them, so the tests' own
  processes also set jax's options from them; a test that moves the cache (a command run
  in-process) gives it back (:func:`_suite_compilation_cache`). A cached program is the
  program XLA would compile (the key covers the computation, the flags, the backend and the
  versions), so results do not depend on it; tests about the cache itself pass their own
  empty folder (``--cache-dir``).

Distribution over the xdist workers (:func:`pytest_xdist_make_scheduler`, :func:`group_of`): the
tests of one file stay on one worker (module fixtures are built once), except that every
notebook and every how-to guide's code is a work unit of its own (executing them is a quarter
of the suite's time) and the tests that load SmolLM2 form one, so that the session fixture
:func:`smollm2` reads the checkpoint once. The units known to be long (:data:`LONG_FIRST`) are
handed out first.

With ``$SVFLOW_TEST_ARTIFACTS`` set (CI sets ``.ci/artifacts``), the controller writes
``durations.tsv`` there: every test's setup + call + teardown seconds (wall), CPU seconds of
its process and of the child processes it waited for, and jax's tracing, lowering, compiling and
cache-loading seconds in its process; then each file's sums and the suite's.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

from svflow_jax.xla_settings import use_project_flags

# jax's options for its persistent compilation cache, the variables that set them, their type.
CACHE_OPTIONS = (("jax_compilation_cache_dir", "JAX_COMPILATION_CACHE_DIR", str),
                 ("jax_persistent_cache_min_compile_time_secs",
                  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", float),
                 ("jax_persistent_cache_min_entry_size_bytes",
                  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", int),
                 ("jax_compilation_cache_max_size", "JAX_COMPILATION_CACHE_MAX_SIZE", int),
                 ("jax_enable_compilation_cache", "JAX_ENABLE_COMPILATION_CACHE",
                  lambda v: v.lower() in ("1", "true", "yes", "on")))

_cache = os.environ.get("SVFLOW_TEST_JAX_CACHE",
                        str(Path.home() / ".cache" / "svflow-jax" / "test-xla"))
if _cache and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")  # prune_cache bounds it
    # the svflow commands the tests start open this folder too, not the user's own
    os.environ.setdefault("SVFLOW_CACHE_DIR", _cache)

# Marked, so that commands, notebook kernels and the docs build that should run as a user runs
# them can drop flags the tests set (scripts_for_tests.users_env); a user's own XLA_FLAGS stay.
# (use_project_flags imports jax, which reads its JAX_* variables once, at import: hence after.)
if "XLA_FLAGS" not in os.environ and use_project_flags(quick=True):
    os.environ["SVFLOW_TESTS_SET_XLA_FLAGS"] = os.environ["XLA_FLAGS"]

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
# A plugin may have imported jax before this file set the variables: the tests' own process
# takes the cache from them here (tests/test_xla_settings.py checks that it is in force).
for _option, _variable, _kind in CACHE_OPTIONS:
    if _variable in os.environ:  # a user's own JAX_COMPILATION_CACHE_DIR may come alone
        jax.config.update(_option, _kind(os.environ[_variable]))

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def _suite_compilation_cache():
    """Gives the next test the suite's compilation cache back when a command run in-process
    moved it (``--cache-dir``) or turned it off (``--no-compile-cache``)."""
    before = {option: getattr(jax.config, option) for option, _, _ in CACHE_OPTIONS}
    yield
    if any(getattr(jax.config, option) != value for option, value in before.items()):
        from jax.experimental.compilation_cache import compilation_cache

        for option, value in before.items():
            jax.config.update(option, value)
        compilation_cache.reset_cache()


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """``tmp_path`` as the current folder, where a test writes a user's module (``svflow ...
    --methods my_layers:NAME`` looks there first); the modules imported from it are forgotten
    afterwards, so another test's module of the same name is read afresh."""
    import sys

    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct in float32, read once per worker (its tests share one group)."""
    import jax.numpy as jnp
    from models_for_tests import fetch_or_skip

    from svflow_jax import checkpoints

    return checkpoints.load(fetch_or_skip(SMOLLM2), dtype=jnp.float32)


def group_of(nodeid: str) -> str:
    """The xdist work unit of a test: its file, except that each notebook is a unit of its own
    and the tests named after SmolLM2 (they use the session fixture :func:`smollm2`) one."""
    path, _, rest = nodeid.split("@")[0].partition("::")
    name = rest.split("[")[0]
    if "smollm2" in name:
        return "smollm2"
    if name == "test_notebook_runs":
        return "notebook-" + rest.split("[", 1)[1].rstrip("]")
    if name == "test_howto_code_runs":
        return "howto-" + rest.split("[", 1)[1].rstrip("]")
    return path


# Groups that take longest go first, so that no worker is left with a long group while the
# other waits at the end (xdist hands out groups in collection order); the rest keep theirs.
# The notebooks come before the docs build, which then finds them executed (the other way
# round, one worker would execute all seven in turn while the other waits on their locks).
LONG_FIRST = ("notebook-", "smollm2", "tests/test_solvers.py", "tests/test_vmf.py",
              "tests/test_diagnostics.py", "howto-", "tests/test_docs.py",
              "tests/test_training.py", "tests/test_claims.py", "tests/test_transformer.py",
              "tests/test_checkpoints.py")


def _rank(group: str) -> int:
    return next((k for k, g in enumerate(LONG_FIRST) if group.startswith(g)), len(LONG_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Puts the long groups first (a stable sort: the order within a file stays)."""
    items.sort(key=lambda item: _rank(group_of(item.nodeid)))


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's file-scope scheduling, with the work units of :func:`group_of` (pytest-xdist's
    own ``--dist loadgroup`` marks do not reach its scheduler under pytest 9.2, whose node ids
    no longer take xdist's ``@group`` suffix). xdist would hand out the units with the most
    tests first (``--loadscope-reorder``, its default), which puts one-test units such as the
    notebooks last, so the order of :data:`LONG_FIRST` is kept instead."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Trims the suite's compilation cache (:func:`svflow_jax.xla_settings.prune_cache`), once per
    run: in the controller, before any worker starts."""
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if (folder and folder == _cache and not hasattr(session.config, "workerinput")
            and Path(folder).is_dir()):
        from svflow_jax.xla_settings import prune_cache

        prune_cache(folder)


# What each test spent, per phase report: wall seconds (pytest's ``duration``), and from the
# process that ran it (a worker) its CPU seconds, the CPU seconds of the child processes it
# waited for (commands, scripts, notebook kernels, the docs build), and jax's tracing, lowering,
# compiling and cache-loading seconds in that process (svflow_jax.xla_settings.compile_stats). The
# worker attaches them to its reports (pytest_runtest_makereport); xdist sends them to the
# controller, which sums them per test (pytest_runtest_logreport).
COSTS = ("seconds", "cpu_s", "children_cpu_s", "trace_s", "lower_s", "compile_s",
         "cache_load_s")
_costs: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(COSTS, 0.0))
_process: dict = {}


def _process_costs() -> dict[str, float]:
    """This process's running totals (the compile statistics are opened at the first call)."""
    import resource
    import time

    if "stats" not in _process:
        from svflow_jax.xla_settings import compile_stats

        _process["context"] = compile_stats()  # kept: its exit would close the statistics
        _process["stats"] = _process["context"].__enter__()  # open for the process's lifetime
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    compile_figures = _process["stats"].as_dict(0.0)
    return {"cpu_s": time.process_time(), "children_cpu_s": children.ru_utime + children.ru_stime,
            **{k: compile_figures[k] for k in COSTS[3:]}}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    now = _process_costs()
    before = _process.get("last", now)
    _process["last"] = now
    outcome.get_result().svflow_costs = {k: now[k] - before[k] for k in now}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    costs = _costs[report.nodeid.split("@")[0]]
    costs["seconds"] += report.duration
    for key, value in (getattr(report, "svflow_costs", None) or {}).items():
        costs[key] += value


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = os.environ.get("SVFLOW_TEST_ARTIFACTS")
    if not folder or hasattr(session.config, "workerinput") or not _costs:
        return
    by_file: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(COSTS, 0.0))
    for nodeid, costs in _costs.items():
        for key, value in costs.items():
            by_file[nodeid.split("::")[0]][key] += value
    total = {key: sum(costs[key] for costs in _costs.values()) for key in COSTS}

    def table(rows: dict[str, dict[str, float]], what: str) -> list[str]:
        ordered = sorted(rows.items(), key=lambda kv: -kv[1]["seconds"])
        return ["\t".join([*COSTS, what])] + [
            "\t".join([*(f"{costs[key]:.2f}" for key in COSTS), name]) for name, costs in ordered]

    lines = [*table(_costs, "test"), "", *table(by_file, "file"), "", *table({"total": total}, "")]
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "durations.tsv").write_text("\n".join(lines) + "\n")
