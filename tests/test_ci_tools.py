"""``.ci/jax_programs.py``: the hook that logs jax's compile records in every process, and the
summary CI writes from them (``.ci/artifacts/jax_programs.tsv``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ci_jax_programs", ROOT / ".ci" / "jax_programs.py")
jax_programs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(jax_programs)


def test_summary_sums_records_by_test_program_and_kind(tmp_path):
    """A hand-written log: two programs traced and lowered, one loaded from the cache, one
    compiled after a miss, one compiled with the cache off; lines of other loggers ignored."""
    (tmp_path / "1.log").write_text(
        "tests\ttests/a.py::t\tFinished tracing f for jit in 0.25 sec\n"
        "tests\ttests/a.py::t\tFinished jaxpr to MLIR module conversion jit(f) in 0.5 sec\n"
        "tests\ttests/a.py::t\tPersistent compilation cache hit for 'jit_f' with key 'k'\n"
        "tests\ttests/a.py::t\tFinished XLA compilation of jit(f) in 0.125 sec\n"
        "tests\ttests/a.py::t\tFinished tracing g for jit in 1.0 sec\n"
        "tests\ttests/a.py::t\tPERSISTENT COMPILATION CACHE MISS for 'jit_g' with key 'k'\n"
        "tests\ttests/a.py::t\tFinished XLA compilation of jit(g) in 2.0 sec\n"
        "tests\ttests/a.py::t\tNot writing persistent cache entry for 'jit_g' because it uses "
        "host callbacks (e.g. from jax.debug.print or breakpoint)\n"
        "tests\ttests/a.py::t\tCompiling jit(g) with global shapes and types\n")
    (tmp_path / "2.log").write_text(
        "child\ttests/a.py::t\tFinished tracing f for jit in 0.75 sec\n"
        "child\ttests/a.py::t\tFinished XLA compilation of jit(f) in 4.0 sec\n")
    (tmp_path / "2.other").write_text("not a log\n")
    per_test, per_program = jax_programs.read(tmp_path)
    assert per_test["tests", "tests/a.py::t"] == {
        "trace_s": 1.25, "lower_s": 0.5, "cache_load_s": 0.125, "compile_s": 2.0,
        "traced": 2, "compiled": 1, "not_cacheable": 1}
    assert per_test["child", "tests/a.py::t"] == {
        "trace_s": 0.75, "lower_s": 0.0, "cache_load_s": 0.0, "compile_s": 4.0,
        "traced": 1, "compiled": 1, "not_cacheable": 0}
    assert per_program["tests", "f"]["cache_load_s"] == 0.125
    assert per_program["tests", "g"]["compile_s"] == 2.0
    assert per_program["tests", "g"]["not_cacheable"] == 1
    totals = jax_programs.summarize(tmp_path, tmp_path / "out.tsv")
    assert totals["child"]["compile_s"] == 4.0 and totals["tests"]["trace_s"] == 1.25
    lines = (tmp_path / "out.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["kind", *jax_programs.COLUMNS, "test"]
    assert lines.count("") == 2  # three tables


def test_hook_records_this_jax_version(tmp_path):
    """The hook, run in a fresh process on an empty compilation cache that jits two functions,
    one holding a host callback: jax's records still carry the messages the summary reads (a
    jax that renamed them would leave the artifact empty)."""
    # its own variable: CI installs the hook in the environment, listening to the real one
    code = (jax_programs.hook("SVFLOW_TEST_HOOK_LOG") + "\nimport jax\n"
            "print(jax.jit(lambda x: x * 3 + 1)(2.0))\n"
            "def counted(x):\n"
            "    jax.debug.callback(lambda v: None, x)\n"
            "    return x - 1\n"
            "print(jax.jit(counted)(2.0))\n")
    env = dict(os.environ, SVFLOW_TEST_HOOK_LOG=str(tmp_path), JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    (log,) = tmp_path.glob("*.log")
    assert log.stem.isdigit()  # <pid>.log
    per_test, per_program = jax_programs.read(tmp_path)
    row = per_test["child", "-"]
    assert row["traced"] >= 2 and row["trace_s"] > 0 and row["lower_s"] > 0
    assert row["compiled"] >= 2 and row["compile_s"] > 0
    assert per_program["child", "counted"]["not_cacheable"] == 1
    assert per_program["child", "<lambda>"]["not_cacheable"] == 0
    assert per_program["child", "<lambda>"]["compiled"] == 1


def test_install_refuses_outside_a_virtual_environment(monkeypatch):
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    with pytest.raises(SystemExit, match="virtual environment"):
        jax_programs.install()


def test_hook_keeps_jax_debug_records_out_of_other_handlers_and_warnings_in(tmp_path):
    """DEBUG records go to the file only; a warning of those loggers still reaches the root's
    handlers (what jax would show without the hook)."""
    code = (jax_programs.hook("SVFLOW_TEST_HOOK_LOG") + "\nimport logging, sys\n"
            "seen = []\n"
            "class Keep(logging.Handler):\n"
            "    def emit(self, record): seen.append((record.levelname, record.getMessage()))\n"
            "logging.getLogger().addHandler(Keep())\n"
            "logging.getLogger('jax._src.compiler').debug('quiet')\n"
            "logging.getLogger('jax._src.compiler').warning('loud')\n"
            "print(seen)\n")
    env = dict(os.environ, SVFLOW_TEST_HOOK_LOG=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[('WARNING', 'loud')]"
    (log,) = tmp_path.glob("*.log")
    assert [line.split("\t")[2] for line in log.read_text().splitlines()] == ["quiet", "loud"]


_mspec = importlib.util.spec_from_file_location("ci_mutants", ROOT / ".ci" / "mutants.py")
mutants = importlib.util.module_from_spec(_mspec)
_mspec.loader.exec_module(mutants)

_TINY = '''"""A module."""
LIMIT = 0.95


def rule(a, b, xs):
    """Docstring 10."""
    if not a < b and b >= 2:
        return -min(xs)
    return f"{a:.3g} {b + 1}" if a == 0 else max(xs).argmax()


def setup(n):
    return n + 7
'''


def test_mutants_of_a_tiny_module(tmp_path):
    """Every operator kind, only in the listed targets (not ``setup``), never in an f-string or
    a docstring; each mutant parses and differs from the original in one place."""
    path = tmp_path / "tiny.py"
    path.write_text(_TINY)
    found = mutants.mutants(path, ["LIMIT", "rule"])
    described = {(m.target, m.kind, m.description) for m in found}
    assert {("LIMIT", "number", "0.95 -> 0.9"), ("LIMIT", "number", "0.95 -> 9.5"),
            ("rule", "compare", "< -> <="), ("rule", "compare", "< -> >="),
            ("rule", "compare", ">= -> >"), ("rule", "compare", "== -> !="),
            ("rule", "boolean", "and -> or"), ("rule", "not", "not x -> x"),
            ("rule", "sign", "-x -> x"), ("rule", "swap", "min -> max"),
            ("rule", "swap", ".argmax -> .argmin"), ("rule", "number", "2 -> 3"),
            ("rule", "number", "0 -> -1")} <= described
    assert not any(m.target == "setup" or "3 ->" in m.description or "10 ->" in m.description
                   for m in found)  # the f-string's format and the docstring are left alone
    lines = _TINY.splitlines()
    for m in found:
        new = m.source.decode().splitlines()
        assert len(new) == len(lines)
        assert sum(a != b for a, b in zip(lines, new, strict=True)) == 1, m
    sign = next(m for m in found if m.kind == "sign")
    assert "return (min(xs))" in sign.source.decode()
    only = mutants.mutants(path, ["rule[b]"])  # the statements that use b
    assert {m.line for m in only} == {7, 9} and not any("xs" in m.description for m in only)
    with pytest.raises(ValueError, match="not found"):
        mutants.mutants(path, ["missing"])


def test_a_patched_module_is_restored_whatever_ends_the_run(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(_TINY)
    for error in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(error), mutants.patched(path, b"broken = ("):
            assert path.read_bytes() == b"broken = ("
            raise error
        assert path.read_text() == _TINY
    with mutants.patched(path, b"x = 1\n"):
        pass
    assert path.read_text() == _TINY


def test_a_mutants_tests_decide_its_status(tmp_path):
    """Exit 0 survived, any failure killed, out of time timeout."""
    run = lambda code, timeout=10: mutants.run_tests(  # noqa: E731
        [sys.executable, "-c", code], timeout, tmp_path)[0]
    assert run("pass") == "survived"
    assert run("raise SystemExit(1)") == "killed" and run("raise SystemExit(4)") == "killed"
    assert run("import time; time.sleep(5)", timeout=0.3) == "timeout"


def test_every_target_exists_and_has_tests():
    assert set(mutants.TARGETS) == set(mutants.TESTS)
    for module, tests in mutants.TESTS.items():
        assert (ROOT / module).is_file()
        assert all((ROOT / t.partition("::")[0]).is_file() for t in tests), module
        for test in tests:  # a node id names a test of its file (a renamed one would be
            path, _, name = test.partition("::")  # "killed" by pytest's exit 4 alone)
            assert not name or f"def {name}(" in (ROOT / path).read_text(), test
    assert len(mutants.all_mutants(["reporting.py"])) >= 1


def test_the_mutants_tests_import_this_checkout():
    """The tests run with this checkout first on ``PYTHONPATH``: they import its package (the
    one the mutants are written into), whatever an editable install points at."""
    assert mutants.imported_from(ROOT).is_relative_to(ROOT.resolve())
    env = mutants._environment(ROOT)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
