"""``svflow verify``: run every registered claim on one context and summarise.

The measurements themselves live in the other modules of :mod:`svflow_jax.claims`; this module
only runs them, counts what JAX compiled (a verify run is mostly compilation on small problems)
and builds the summary that :mod:`svflow_jax.claims.report` writes. The persistent compilation cache
(:func:`svflow_jax.xla_settings.enable_compilation_cache`) makes a second run reuse the first
run's XLA programs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from ..environment import environment
from ..xla_settings import compile_stats
from . import measure as _measure
from .core import Claim, ClaimResult, Context, Options, run_claims, select

__all__ = ["SCHEMA_VERSION", "run", "summary"]

SCHEMA_VERSION = 2

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
