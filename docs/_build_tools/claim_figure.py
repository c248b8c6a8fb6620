"""The home page's figure: the claim in one picture, measured at build time by the claims.

Three registered claims of ``svflow verify`` on its ``--quick`` problem (random weights, a smooth
``theta(t)``, float64):

* ``exactness/postnorm-projected``: a projected post-norm Transformer and the retracted-Euler
  solve of its flow agree at every layer to round-off (left panel);
* ``standard-layer/stack-order`` and ``order/euler``: as depth grows (``h = T / L``) the standard
  Transformer stack and the retracted Euler solve converge to the continuous flow at order 1
  (right panel).

The figure is built from the claims' own result rows (the numbers ``svflow verify`` reports), and
the build fails if a claim does not pass.
"""

from __future__ import annotations

import io

CLAIMS = ("exactness/postnorm-projected", "order/euler", "standard-layer/stack-order")
QUICK = dict(tokens=4, dim=8, layers=8, repeats=1, depths=(16, 32, 64, 128))


def measure() -> dict[str, dict]:
    """Runs the three claims; returns their JSON results by name.

    Raises:
        RuntimeError: a claim did not pass.
    """
    import jax

    jax.config.update("jax_enable_x64", True)
    from svflow_jax.claims import Options, run, select

    results, _ = run.run(Options(**QUICK), select(list(CLAIMS)))
    found = {r.name: r.to_json() for r in results}
    failed = [name for name, r in found.items() if r["passed"] is not True]
    if failed or set(found) != set(CLAIMS):
        raise RuntimeError(f"home-page claims did not pass: {failed or sorted(found)}")
    return found


def png(results: dict[str, dict]) -> bytes:
    """The two-panel PNG (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    exact = results["exactness/postnorm-projected"]
    euler = results["order/euler"]
    stack = results["standard-layer/stack-order"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))

    layers = [r["layer"] for r in exact["rows"]]
    diffs = [max(r["max_abs_diff"], 1e-18) for r in exact["rows"]]
    left.semilogy(layers, diffs, "o-", color="C0", label="|Transformer - retracted Euler|")
    left.axhline(np.finfo(np.float64).eps, color="gray", ls=":", label="float64 epsilon")
    left.axhline(1e-12, color="C3", ls="--", lw=1, label="criterion 1e-12")
    left.set(xlabel="layer l", ylabel="largest difference of hidden states", ylim=(1e-18, 1e-2),
             title="A Transformer IS the Euler solve of its flow")
    left.legend(fontsize=8, loc="upper left")
    left.grid(True, which="both", alpha=0.3)

    rows = [r for r in euler["rows"] if r["error"] > 0]
    f = euler["figures"]
    right.loglog([r["step_size"] for r in rows], [r["error"] for r in rows], "s-", color="C0",
                 mfc="none", label=f"retracted Euler solve (order {f['fitted_order']:.2f})")
    g = stack["figures"]
    right.loglog([r["step_size"] for r in stack["rows"]],
                 [r["error_sphere_flow"] for r in stack["rows"]], "o-", color="C1",
                 label=f"standard post-norm Transformer (order {g['fitted_order']:.2f})")
    h = np.array([rows[0]["step_size"], rows[-1]["step_size"]])
    right.loglog(h, rows[-1]["error"] * h / h[-1], ":", color="gray", label="slope 1")
    right.set(xlabel="step size h = T / depth", ylabel="geodesic error at T",
              title="... and converges to the ODE on the sphere as depth grows")
    right.legend(fontsize=8)
    right.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()
