"""The claims layer: every statement the project checks with numbers, measured one way.

A claim is a registered function ``measure(ctx) -> Evidence``; :meth:`Claim.run` turns it into
a :class:`ClaimResult` (statement, figures, tolerance, ``passed``, table rows, seconds).
``svflow verify`` runs them all (:func:`run_claims`) and writes the report from the results;
the tests run the same claims on small options and assert on the same objects.

Modules:

* :mod:`.core`        results, the registry (:func:`claim`, :func:`select`), :class:`Options`,
                      the shared :class:`Context`;
* :mod:`.measure`     the error metric, the reference solves, the tolerances, the order fit;
* :mod:`.problem`     the random Transformer weights and the smooth test flow;
* :mod:`.exactness`   a Transformer IS its flow's solver (each block variant, float32, gains,
                      round trip);
* :mod:`.orders`      orders of every registered solver, of the splittings, of per-layer
                      weights; drift off the sphere;
* :mod:`.stacks`      stacks as depth grows: the standard layer, pre-norm, Norm gains;
* :mod:`.run`         ``svflow verify``'s run: every chosen claim on one context, the compile
                      statistics, the ``summary.json`` dictionary;
* :mod:`.report`      ``svflow verify``'s report from that summary: CSV, PNG, ``report.md``.

To add a claim: write ``measure(ctx) -> Evidence`` in one of these modules (or your own, imported
before the run) and decorate it with ``@claim(name, section, statement)``.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for readers and the API docs
    from .core import (
        QUICK,
        Claim,
        ClaimResult,
        Context,
        Evidence,
        Options,
        all_claims,
        claim,
        claim_family,
        get,
        run_claims,
        select,
    )
    from .orders import order_claim, solver_sweep

__all__ = [
    "QUICK",
    "Claim",
    "ClaimResult",
    "Context",
    "Evidence",
    "Options",
    "all_claims",
    "claim",
    "claim_family",
    "get",
    "order_claim",
    "run_claims",
    "select",
    "solver_sweep",
]

#: the modules that register the claims, in report order. They import JAX, so they are loaded
#: with the first name asked of this package (PEP 562), not by ``import svflow_jax.claims``:
#: ``svflow_jax.claims.core.Options`` checks ``svflow verify``'s options before JAX is imported.
REGISTERING = ("exactness", "orders", "stacks")
_WHERE = {name: ".orders" if name in ("order_claim", "solver_sweep") else ".core"
          for name in __all__}
_SUBMODULES = ("core", "measure", "problem", "report", "run", *REGISTERING)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        for module in REGISTERING:
            importlib.import_module(f".{module}", __name__)
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
