"""The XLA flags the project sets for its own commands and experiments.

XLA reads ``XLA_FLAGS`` once, when JAX starts its CPU client, so :func:`use_project_flags` must
run before the first array exists. A user's own ``XLA_FLAGS`` always wins: when the variable is
set, nothing is changed.

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

import os

__all__ = ["QUICK_FLAGS", "FULL_FLAGS", "use_project_flags"]

QUICK_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
               "--xla_cpu_use_fusion_emitters=false")
FULL_FLAGS = ""


def use_project_flags(quick: bool = False) -> str:
    """Sets ``XLA_FLAGS`` to the project's flags for a quick or a full run unless the user set
    it; returns the value in force."""
    if "XLA_FLAGS" not in os.environ:
        flags = QUICK_FLAGS if quick else FULL_FLAGS
        if flags:
            os.environ["XLA_FLAGS"] = flags
    return os.environ.get("XLA_FLAGS", "")
