"""``svflow verify``: run every registered claim on one context and summarise.

The measurements themselves live in :mod:`svflow_jax.claims`; this module only runs them, counts
what JAX compiled (a verify run is mostly compilation on small problems) and builds the summary
that :mod:`svflow_jax.report` writes. The persistent compilation cache
(:func:`enable_compilation_cache`) makes a second run reuse the first run's XLA programs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax

from .claims import Claim, ClaimResult, Context, Options, run_claims, select
from .claims import measure as _measure
from .environment import environment

__all__ = ["CACHE_LIMIT", "SCHEMA_VERSION", "CompileStats", "compile_stats", "default_cache_dir",
           "enable_compilation_cache", "prune_cache", "run", "summary"]

SCHEMA_VERSION = 2

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_LOAD = "/jax/compilation_cache/cache_retrieval_time_sec"


def default_cache_dir() -> Path:
    """``$SVFLOW_CACHE_DIR``, else ``$XDG_CACHE_HOME/svflow-jax/xla``, else
    ``~/.cache/svflow-jax/xla``."""
    if "SVFLOW_CACHE_DIR" in os.environ:
        return Path(os.environ["SVFLOW_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "svflow-jax" / "xla"


#: The size :func:`enable_compilation_cache` trims a cache folder to when it opens it (bytes).
CACHE_LIMIT = 2 * 1024**3


def prune_cache(folder: str | Path, limit: int = CACHE_LIMIT) -> int:
    """Deletes the programs of JAX's cache ``folder`` (``<key>-cache`` files, and the
    ``<key>-atime`` files of JAX's own bound) used longest ago (the later of the file's access
    and modification times) until the rest take at most ``limit`` bytes; returns how many.
    Other files stay."""
    programs = []
    for path in Path(folder).glob("*-cache"):
        try:
            stat = path.stat()
        except FileNotFoundError:  # deleted meanwhile
            continue
        programs.append((max(stat.st_atime, stat.st_mtime), stat.st_size, path))
    total = sum(size for _, size, _ in programs)
    deleted = 0
    for _, size, path in sorted(programs, key=lambda p: p[0]):
        if total <= limit:
            break
        path.unlink(missing_ok=True)
        path.with_name(path.name.removesuffix("-cache") + "-atime").unlink(missing_ok=True)
        total -= size
        deleted += 1
    return deleted


def enable_compilation_cache(path: str | Path | None = None,
                             limit: int | None = CACHE_LIMIT) -> Path:
    """JAX's persistent compilation cache in ``path`` (default :func:`default_cache_dir`),
    keeping every program however quick to compile. Call before the first compilation; called
    later, it moves the cache there (JAX opens its cache folder once, at the first compilation,
    so the cache is reset when the folder changes).

    JAX's own cache has no bound by default, so a folder this call opens is first trimmed to
    ``limit`` bytes (:func:`prune_cache`; ``None``: not trimmed). A folder already in force,
    e.g. from ``$JAX_COMPILATION_CACHE_DIR``, is left to whoever set it."""
    path = Path(path) if path is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != str(path):
        from jax.experimental.compilation_cache import compilation_cache

        if limit is not None:
            prune_cache(path, limit)
        jax.config.update("jax_compilation_cache_dir", str(path))
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class CompileStats:
    """Counts XLA compilations and sums the time spent tracing, lowering, compiling and loading
    cached programs, from JAX's monitoring events."""

    def __init__(self) -> None:
        self.seconds = {"trace": 0.0, "lower": 0.0, "compile": 0.0, "cache_load": 0.0}
        self.compilations = 0
        self.cache_hits = 0
        self.active = False

    def _duration(self, event: str, duration: float, **_: Any) -> None:
        if not self.active:
            return
        if event == _TRACE:
            self.seconds["trace"] += duration
        elif event == _LOWER:
            self.seconds["lower"] += duration
        elif event == _BACKEND:
            self.seconds["compile"] += duration
            self.compilations += 1
        elif event == _CACHE_LOAD:
            self.seconds["cache_load"] += duration

    def _event(self, event: str, **_: Any) -> None:
        if self.active and event == _CACHE_HIT:
            self.cache_hits += 1

    def as_dict(self, busy: float) -> dict[str, Any]:
        """The ``compile`` figures; ``busy`` is the claims' seconds added up (thread-seconds,
        like the events' durations, so ``run_s`` stays meaningful when claims run at once)."""
        # JAX's backend-compile event wraps the persistent-cache lookup too: a program loaded
        # from the cache is not a compilation, and its load time is not compile time.
        seconds = dict(self.seconds)
        seconds["compile"] = max(seconds["compile"] - seconds["cache_load"], 0.0)
        spent = sum(seconds.values())
        return {"xla_compilations": self.compilations - self.cache_hits,
                "cache_hits": self.cache_hits, **{f"{k}_s": v for k, v in seconds.items()},
                "compile_total_s": spent, "busy_s": busy, "run_s": max(busy - spent, 0.0)}


_LISTENING: list[CompileStats] = []
_REGISTERED: list[bool] = []  # JAX's listeners cannot be removed: register one dispatcher, once


@contextlib.contextmanager
def compile_stats() -> Iterator[CompileStats]:
    """``with compile_stats() as stats:`` counts what is compiled inside the block."""
    if not _REGISTERED:
        _REGISTERED.append(True)
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, duration, **kw: [s._duration(event, duration, **kw)
                                           for s in _LISTENING])
        jax.monitoring.register_event_listener(
            lambda event, **kw: [s._event(event, **kw) for s in _LISTENING])
    stats = CompileStats()
    stats.active = True
    _LISTENING.append(stats)
    try:
        yield stats
    finally:
        stats.active = False
        _LISTENING.remove(stats)


def run(
    options: Options, claims: Iterable[Claim] | None = None,
    progress: Callable[[str], None] | None = None, workers: int = 1,
) -> tuple[list[ClaimResult], dict[str, Any]]:
    """Runs ``claims`` (default: every registered claim); returns the results and the compile
    statistics (with ``total_s``).

    Args:
        options: the run's sizes, dtype and seed.
        claims: the claims to run (:func:`svflow_jax.claims.select`); default all.
        progress: called with each claim's name when it is done.
        workers: claims run at once, in threads (:func:`svflow_jax.claims.run_claims`).
            Every ``*_s`` figure but ``total_s`` (wall time) is thread-seconds: with several
            workers they add up the threads, and ``busy_s`` (the claims' seconds added up)
            exceeds ``total_s``; ``run_s = busy_s - compile_total_s`` is the rest (running the
            programs, NumPy, Python).

    Returns:
        ``(results, compile)``: one :class:`~svflow_jax.claims.ClaimResult` per claim, and the
        ``compile`` dictionary of ``summary.json`` (XLA compilations, cache hits, seconds).
    """
    claims = select() if claims is None else list(claims)
    start = time.perf_counter()
    with compile_stats() as stats:
        results = run_claims(Context(options), claims, progress, workers)
    total = time.perf_counter() - start
    busy = sum(r.seconds for r in results)
    return results, {**stats.as_dict(busy), "total_s": total}


def summary(
    results: list[ClaimResult], options: Options, compile: dict[str, Any],
    extra_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``summary.json``: ``passed`` is true when no claim failed (``None``, unresolved in
    float32, does not fail).

    Args:
        results: what :func:`run` returned.
        options: the options of the run.
        compile: the compile statistics :func:`run` returned.
        extra_config: more keys for ``config`` (the command line adds ``quick``, ``only``,
            ``compile_cache``).

    Returns:
        The ``summary.json`` dictionary, schema version :data:`SCHEMA_VERSION` (documented in
        the site's "Report formats").
    """
    config = {**vars(options), "depths": list(options.depths), **(extra_config or {}),
              "reference_tolerance": _measure.REFERENCE_TOLERANCE,
              "fit_floor": _measure.fit_floor(options.dtype), "fit_ceiling": _measure.FIT_CEILING,
              "min_steps_in_fit": _measure.MIN_STEPS_IN_FIT, **_measure.precision_in_force()}
    return {
        "schema_version": SCHEMA_VERSION,
        "passed": all(r.passed is not False for r in results),
        "config": config,
        "claims": [r.to_json() for r in results],
        "compile": compile,
        "timings": {"total_s": compile["total_s"], **{r.name: r.seconds for r in results}},
        "environment": environment(),
    }
