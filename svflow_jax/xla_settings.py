"""The XLA flags the project sets for its own commands and experiments.

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
  (``--xla_cpu_use_fusion_emitters=false``), which at that level compile in half the time.
  Compile time of six of ``svflow verify --quick``'s programs (three exactness stacks, fixed-step
  RK4, Tsit5 and RKMK4; idle 2-core CPU, jax 0.10.2, 2026-12-03; median of 3 fresh compiles
  each, summed; two processes per setting): XLA's defaults 4.0-4.3 s; level 0 alone 3.3-4.0 s;
  level 0 and expensive passes off 2.5-3.0 s; all three flags 1.35-1.94 s. The fusion emitters
  flag alone (level 2) gives 4.0-4.1 s: only together do they pay. Every claim's result stays
  within its tolerance; run times of the programs are those of unoptimised code, so a quick
  run's timings are not the ones to quote.
* full runs: no flag (XLA's defaults). Their timings are figures of the report, and none of
  the CPU flags measured below made the programs faster by more than the noise; the quick
  flags would make ``svflow verify``'s default run compile faster (71 s -> 46 s on an empty
  cache) but run slower (25 s -> 32 s with every program cached; the float64 Dopri8
  references twice as slow).

How the CPU flags were measured (``experiments/peer_benchmark.py --xla-flags FLAGS``: two JAX
workers, without and with the flags, the same protocol as the peer benchmark, agreement of every
output checked first; 2026-12-03, idle 2-core CPU, jax 0.10.2, 5 rounds; cases forward Euler
and RK4 over 64 steps, the RK4 gradient, the Flax Transformer forward and one training step, at
``n = 32, d = 64`` and ``n = d = 256``, float32 and float64; ratio = time without / with):

* ``--xla_cpu_use_xnnpack=true``: 0.87-1.27 (median over the 20 cells 0.99);
* ``--xla_cpu_use_thunk_runtime=false``: 0.85-1.12, median 1.00 (XLA says the flag "is no longer
  supported": it is ignored);
* ``--xla_cpu_use_onednn=true``: 0.77-1.07, median 1.00;
* ``--xla_cpu_multi_thread_eigen=false``: 0.88-1.09, median 1.02.

The null comparison, two identical workers (``--xla-flags ""``), spreads 0.89-1.20, median
0.98. Every output agreed (float64 to 1e-12, float32 to 1e-5 relative); no flag was faster in
every cell or by more than that spread, so none is adopted.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
from collections.abc import Sequence

__all__ = ["QUICK_FLAGS", "FULL_FLAGS", "accelerator_plugins", "expected_platform",
           "project_flags", "use_project_flags"]

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
        platforms: the ``JAX_PLATFORMS`` value (default: ``jax.config.jax_platforms``, which
            reads the environment variable); empty or ``None``: not set.
        plugins: the installed accelerator plugins (default :func:`accelerator_plugins`).
    """
    if platforms is None:
        import jax

        platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
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
