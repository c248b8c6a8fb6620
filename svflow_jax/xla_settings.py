"""The XLA flags the project sets for its own commands and experiments, JAX's persistent
compilation cache and the count of what JAX compiles.

Every command opens the same persistent compilation cache (:func:`enable_compilation_cache`,
in :func:`default_cache_dir`, trimmed to :data:`CACHE_LIMIT` by :func:`prune_cache`), so a
second run reuses the first run's XLA programs; :func:`compile_stats` counts the compilations
and the seconds spent tracing, lowering, compiling and loading cached programs.

XLA reads ``XLA_FLAGS`` once, when JAX starts its first backend, so :func:`use_project_flags` must
run before the first array exists. A user's own ``XLA_FLAGS`` always wins: when the variable is
set, nothing is changed.

The flags are chosen per backend, and the backend is decided without starting one
(:func:`expected_platform`): the quick flags below are CPU compiler flags, and a GPU build of
jaxlib refuses a ``--xla_cpu_*`` flag it does not know ("Unknown flag in XLA_FLAGS") and exits.
The rule, JAX's own order of choice read from outside:

1. ``JAX_PLATFORMS`` (or ``jax.config.jax_platforms``) set: its first entry is the backend
   (``cpu``; ``cuda``, ``rocm``, ``gpu``, ``tpu``, ...: an accelerator);
2. unset: an installed accelerator plugin (a module of the ``jax_plugins`` namespace package or
   a ``jax_plugins`` entry point, such as ``jax_cuda13_plugin``; or ``libtpu``) makes it an
   accelerator, which JAX prefers to the CPU; none: the CPU.

A plugin installed on a machine without its device makes JAX fall back to the CPU; the rule then
says accelerator and no flag is set: such a run only compiles slower, it never fails.
On an accelerator no flag is set (XLA's defaults, in quick and full runs alike).

* quick runs (``svflow verify --quick``, the experiments' ``--quick``): tiny problems, where run
  time is nothing and compile time everything. :data:`QUICK_FLAGS` skips LLVM's optimisations
  (``--xla_backend_optimization_level=0``, ``--xla_llvm_disable_expensive_passes=true``, what
  ``jax_disable_most_optimizations`` sets) and emits fusions with XLA's older loop emitters
  (``--xla_cpu_use_fusion_emitters=false``), which at that level compile faster. Only the
  three together pay: they compile these small programs in well under half the time of XLA's
  defaults (the timings are on ``docs/results/peer-benchmark.md``). Every claim's result stays
  within its tolerance; run times of the programs are those of unoptimised code, so a quick
  run's timings are not the ones to quote.
* full runs: no flag (XLA's defaults). Their timings are figures of the report, and none of
  the CPU flags tried made the programs faster by more than the noise; the quick flags
  would make ``svflow verify``'s default run compile faster but run slower.

The CPU flags were measured with ``experiments/peer_benchmark.py --xla-flags FLAGS`` (two JAX
workers, without and with the flags, the same protocol as the peer benchmark, agreement of every
output checked first): ``--xla_cpu_use_xnnpack=true``, ``--xla_cpu_use_thunk_runtime=false``,
``--xla_cpu_use_onednn=true`` and ``--xla_cpu_multi_thread_eigen=false``. Every output agreed,
and no flag was faster than two identical workers differ from each other, so none is adopted;
the ratios are on ``docs/results/peer-benchmark.md``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["QUICK_FLAGS", "FULL_FLAGS", "accelerator_plugins", "expected_platform",
           "project_flags", "use_project_flags", "CACHE_LIMIT", "default_cache_dir",
           "prune_cache", "enable_compilation_cache", "CompileStats", "compile_stats"]

QUICK_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
               "--xla_cpu_use_fusion_emitters=false")
FULL_FLAGS = ""


def accelerator_plugins() -> tuple[str, ...]:
    """The installed JAX accelerator plugins, found as JAX finds them (the ``jax_plugins``
    namespace package and entry points) but without importing them, plus ``libtpu``."""
    names: set[str] = set()
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        names.update(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations))
    from importlib.metadata import entry_points

    names.update(e.value for e in entry_points(group="jax_plugins"))
    if importlib.util.find_spec("libtpu") is not None:
        names.add("libtpu")
    return tuple(sorted(names))


def expected_platform(platforms: str | None = None,
                      plugins: Sequence[str] | None = None) -> str:
    """``"cpu"`` or ``"accelerator"``: the backend JAX will start, decided without starting one
    (the rule of the module's docstring).

    Args:
        platforms: the ``JAX_PLATFORMS`` value (default: ``jax.config.jax_platforms`` where
            JAX is imported, else the environment variable it reads: the command line decides
            before importing JAX); empty or ``None``: not set.
        plugins: the installed accelerator plugins (default :func:`accelerator_plugins`).
    """
    if platforms is None:  # jax's option where jax is imported; else the variable it reads
        jax = sys.modules.get("jax")
        config = getattr(jax, "config", None)
        platforms = (getattr(config, "jax_platforms", None)
                     or os.environ.get("JAX_PLATFORMS", ""))
    first = platforms.split(",")[0].strip().lower() if platforms else ""
    if first:
        return "cpu" if first == "cpu" else "accelerator"
    plugins = accelerator_plugins() if plugins is None else plugins
    return "accelerator" if plugins else "cpu"


def project_flags(quick: bool = False, platform: str | None = None) -> str:
    """The project's ``XLA_FLAGS`` for a quick or a full run on ``platform`` (``"cpu"`` or
    ``"accelerator"``; default :func:`expected_platform`): :data:`QUICK_FLAGS` for a quick run
    on the CPU, else none."""
    platform = expected_platform() if platform is None else platform
    if platform not in ("cpu", "accelerator"):
        raise ValueError(f"platform must be 'cpu' or 'accelerator', got {platform!r}")
    if platform != "cpu":
        return ""
    return QUICK_FLAGS if quick else FULL_FLAGS


def use_project_flags(quick: bool = False, platform: str | None = None) -> str:
    """Sets ``XLA_FLAGS`` to :func:`project_flags` unless the user set it; returns the value in
    force. Call before the first array exists."""
    if "XLA_FLAGS" not in os.environ:
        flags = project_flags(quick, platform)
        if flags:
            os.environ["XLA_FLAGS"] = flags
    return os.environ.get("XLA_FLAGS", "")


# ============================================================================================
# The persistent compilation cache, and what JAX compiles
# ============================================================================================

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
    import jax

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
        import jax

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
