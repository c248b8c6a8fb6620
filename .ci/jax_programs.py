"""Where the suite's JAX time goes, in every process it starts (standard library only).

``durations.tsv`` reads jax's tracing, lowering and compiling seconds in the pytest processes
only (``jax.monitoring`` events, :mod:`tests.conftest`); the commands, scripts, notebook kernels
and the docs build that the tests start are child processes, out of its reach. jax writes the
same figures to its loggers at DEBUG level, for each program:

* ``Finished tracing NAME for jit in T sec`` (tracing);
* ``Finished jaxpr to MLIR module conversion jit(NAME) in T sec`` (lowering);
* ``Finished XLA compilation of jit(NAME) in T sec``, after ``Persistent compilation cache hit``
  (a program loaded from the cache: T is the loading) or ``PERSISTENT COMPILATION CACHE MISS``
  (compiled, then written unless it holds a host callback, which jax never caches), or after
  neither when the cache is off (compiled).

Usage:

``python3 .ci/jax_programs.py install``
    with a virtual environment's Python: writes a ``sitecustomize.py`` into its site-packages,
    so that every Python process of that environment started with ``$SVFLOW_CI_JAX_LOG`` set
    to a folder sends those records to ``FOLDER/<pid>.log`` (opened at the first record: a
    process that compiles nothing writes nothing), each line stamped with the kind of process
    (``tests``: one that runs pytest; ``child``: one a test started) and
    ``$PYTEST_CURRENT_TEST`` (the test that runs, or that started the process). Refused
    outside a virtual environment: it changes every process of the environment.

``python3 .ci/jax_programs.py summarize FOLDER OUT.tsv``
    sums the logs into ``OUT.tsv``: per test and kind of process, the seconds of tracing,
    lowering, loading cached programs and compiling, the number of programs traced and
    compiled, and how many of those jax did not write to its cache because they hold a host
    callback (``not_cacheable``); then the same per program name; then the totals per kind of
    process, which it also prints. Threads of one process that compile at once (``svflow
    verify --workers``) can pair a compilation with another's cache record: the split between
    loading and compiling is then approximate, their sum is not.
"""

from __future__ import annotations

import sys
import sysconfig
from collections import defaultdict
from pathlib import Path

VARIABLE = "SVFLOW_CI_JAX_LOG"
MARK = "# Written by .ci/jax_programs.py install"


def hook(variable: str = VARIABLE) -> str:
    """The ``sitecustomize.py`` that :func:`install` writes, listening to ``$variable``."""
    return f'''{MARK}: logs jax's tracing, lowering and compiling (see there).
import os

if os.environ.get("{variable}"):
    import logging
    import sys

    class _Stamp(logging.Filter):
        def filter(self, record):
            record.kind = "tests" if "_pytest" in sys.modules else "child"
            record.test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" (")[0]
            return True

    class _Upward(logging.Handler):
        """What jax would show anyway goes up as before; its DEBUG records go to the file only
        (pytest would otherwise capture them with every test's log)."""
        def emit(self, record):
            jax_logger = logging.getLogger("jax")
            if record.levelno >= jax_logger.getEffectiveLevel():
                jax_logger.handle(record)

    _handler = logging.FileHandler(
        os.path.join(os.environ["{variable}"], f"{{os.getpid()}}.log"), delay=True)
    _handler.setFormatter(logging.Formatter("%(kind)s\\t%(test)s\\t%(message)s"))
    _handler.addFilter(_Stamp())
    for _name in ("jax._src.dispatch", "jax._src.compiler"):
        _logger = logging.getLogger(_name)
        _logger.setLevel(logging.DEBUG)
        _logger.propagate = False
        _logger.addHandler(_handler)
        if not any(type(h).__name__ == "_Upward" for h in _logger.handlers):
            _logger.addHandler(_Upward())  # once, however many hooks listen
'''

COLUMNS = ("trace_s", "lower_s", "cache_load_s", "compile_s", "traced", "compiled",
           "not_cacheable")


def install() -> Path:
    if sys.prefix == sys.base_prefix:
        raise SystemExit("jax_programs.py install: run it with a virtual environment's Python")
    target = Path(sysconfig.get_paths()["purelib"]) / "sitecustomize.py"
    if target.exists() and not target.read_text().startswith(MARK):
        raise SystemExit(f"jax_programs.py install: {target} exists and is not ours")
    target.write_text(hook())
    return target


def _seconds(message: str) -> float:
    return float(message.rsplit(" in ", 1)[1].split()[0])


def _name(message: str, after: str) -> str:
    name = message.split(after, 1)[1].rsplit(" in ", 1)[0]
    return name[4:-1] if name.startswith("jit(") and name.endswith(")") else name


def read(folder: Path) -> tuple[dict, dict]:
    """Sums per ``(kind, test)`` and per ``(kind, program name)``."""
    per_test: dict = defaultdict(lambda: dict.fromkeys(COLUMNS, 0.0))
    per_program: dict = defaultdict(lambda: dict.fromkeys(COLUMNS, 0.0))
    for log in sorted(folder.glob("*.log")):
        cached = None
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split("\t", 2)
            if len(parts) != 3:
                continue
            kind, test, message = parts
            if message.startswith("Finished tracing "):
                name = message[len("Finished tracing "):].rsplit(" for ", 1)[0]
                column, seconds = "trace_s", _seconds(message)
            elif message.startswith("Finished jaxpr to MLIR module conversion "):
                name = _name(message, "conversion ")
                column, seconds = "lower_s", _seconds(message)
            elif message.startswith("Persistent compilation cache hit"):
                cached = True
                continue
            elif message.startswith("PERSISTENT COMPILATION CACHE MISS"):
                cached = False
                continue
            elif (message.startswith("Not writing persistent cache entry")
                  and "host callbacks" in message):
                name = message.split("'")[1].removeprefix("jit_")
                for row in (per_test[kind, test], per_program[kind, name]):
                    row["not_cacheable"] += 1
                continue
            elif message.startswith("Finished XLA compilation of "):
                name = _name(message, "compilation of ")
                column, seconds = ("cache_load_s" if cached else "compile_s"), _seconds(message)
                cached = None
            else:
                continue
            for row in (per_test[kind, test], per_program[kind, name]):
                row[column] += seconds
                if column == "trace_s":
                    row["traced"] += 1
                elif column == "compile_s":
                    row["compiled"] += 1
    return per_test, per_program


def summarize(folder: Path, out: Path) -> dict[str, dict[str, float]]:
    per_test, per_program = read(folder)
    totals: dict = defaultdict(lambda: dict.fromkeys(COLUMNS, 0.0))
    for (kind, _), row in per_test.items():
        for column in COLUMNS:
            totals[kind][column] += row[column]

    def table(rows: dict, what: str) -> list[str]:
        ordered = sorted(rows.items(), key=lambda kv: -sum(kv[1][c] for c in COLUMNS[:4]))
        return ["\t".join(["kind", *COLUMNS, what])] + [
            "\t".join([kind, *(f"{row[c]:.2f}" if c.endswith("_s") else f"{row[c]:.0f}"
                               for c in COLUMNS), name])
            for (kind, name), row in ordered]

    lines = [*table(per_test, "test"), "", *table(per_program, "program"), "",
             *table({(kind, "total"): row for kind, row in totals.items()}, "")]
    out.write_text("\n".join(lines) + "\n")
    return dict(totals)


def main(argv: list[str]) -> None:
    if argv[:1] == ["install"] and len(argv) == 1:
        print(f"jax's compile records go to ${VARIABLE} when set: {install()}")
    elif argv[:1] == ["summarize"] and len(argv) == 3:
        totals = summarize(Path(argv[1]), Path(argv[2]))
        for kind, row in sorted(totals.items()):
            print(f"jax in {kind} processes: " + ", ".join(
                f"{c.removesuffix('_s')} {row[c]:.0f} s" for c in COLUMNS[:4])
                + f" ({row['traced']:.0f} programs traced, {row['compiled']:.0f} compiled, "
                  f"{row['not_cacheable']:.0f} of them not cacheable: host callbacks)")
    else:
        raise SystemExit(__doc__.split("Usage:", 1)[1])


if __name__ == "__main__":
    main(sys.argv[1:])
