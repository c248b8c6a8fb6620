"""Which solver makes the best Transformer layer, for the same compute? The command line of the
layer-design study; its parts are the modules of ``experiments/layer_designs/``.

Run::

    python experiments/layer_designs.py [--part baseline|depth|designs|ngpt|recipe|convergence]
        [--out results/layer_designs] [--quick] [--seeds 3] [--arms ARM ...]

* ``--part designs`` (:mod:`layer_designs.designs`): every design at equal compute, width 64;
* ``--part ngpt`` (the same module): nGPT's normalised step against the residual step, in
  ``ngpt/``;
* ``--part depth`` (:mod:`layer_designs.depth`): a trained stack as a discretisation of its flow;
* ``--part baseline`` (:mod:`layer_designs.baseline`): tunes and trains ``svflow train``'s
  recipe;
* ``--part recipe`` (:mod:`layer_designs.recipe`, only when named): designs at the recipe's
  size, each paired by seed with the recipe; ``--arms`` and ``--seeds`` split it into pieces;
* ``--part convergence`` (:mod:`layer_designs.convergence`, only when named): the Richardson
  sequence of trained stacks to 32 times their blocks against an untrained control.

Without ``--part`` the first four run. ``--quick`` runs each part at CI size. Results and how
long each part takes: ``docs/results/layer-designs.md`` and ``docs/results/baseline.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# the repository (svflow_jax) and this folder (the study's package, also when imported by a test)
sys.path[:0] = [str(_HERE.parent), str(_HERE)]
from layer_designs.baseline import run_baseline  # noqa: E402
from layer_designs.common import DEFAULT, QUICK  # noqa: E402
from layer_designs.convergence import (  # noqa: E402
    CONVERGENCE,
    CONVERGENCE_QUICK,
    run_convergence,
)
from layer_designs.depth import DEPTH, DEPTH_QUICK, run_depth  # noqa: E402
from layer_designs.designs import NGPT, NGPT_QUICK, run_designs  # noqa: E402
from layer_designs.recipe import RECIPE, RECIPE_QUICK, run_recipe  # noqa: E402

from svflow_jax.cli.types import positive_int  # noqa: E402 (no JAX: flags are set in main)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["baseline", "depth", "designs", "ngpt", "recipe",
                                      "convergence"],
                   help="run one part only (default: the first four; recipe and convergence "
                   "only when named)")
    p.add_argument("--out", default="results/layer_designs", help="output folder")
    p.add_argument("--quick", action="store_true", help="tiny CI run (< 2 minutes)")
    p.add_argument("--seeds", type=positive_int, help="seeds per design (default 3; quick 2)")
    p.add_argument("--steps", type=positive_int,
                   help="optimiser steps per run (default 400; quick 12)")
    p.add_argument("--designs", nargs="+", help="designs to compare (default: all eight)")
    p.add_argument("--arms", nargs="+", metavar="ARM",
                   help="--part recipe: the arms to train besides the recipe (default: all; "
                   "quoted names of RECIPE's arms)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: write the report from the runs already in --out "
                   "(over the seeds each design has; throughput is measured)")
    return p.parse_args(argv)


def settings(args) -> dict:
    s = dict(QUICK if args.quick else DEFAULT)
    for name in ("seeds", "steps", "designs"):
        if getattr(args, name) is not None:
            s[name] = getattr(args, name)
    return s


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.arms is not None and args.part != "recipe":
        print(f"{Path(__file__).name}: error: --arms: only with --part recipe", file=sys.stderr)
        return 2
    unknown = [arm for arm in args.arms or () if arm not in RECIPE["arms"]]
    if unknown:
        print(f"{Path(__file__).name}: error: --arms: unknown arm {unknown[0]!r} (one of "
              f"{', '.join(map(repr, RECIPE['arms']))})", file=sys.stderr)
        return 2
    from svflow_jax.xla_settings import use_project_flags

    use_project_flags(quick=args.quick)  # before JAX starts; a user's XLA_FLAGS win
    from svflow_jax.solvers import catalogue

    s = settings(args)
    try:  # before anything is written or compiled
        for name in s["designs"]:
            catalogue.get(name, what="design")
    except ValueError as err:
        print(f"{Path(__file__).name}: error: --designs: {err}", file=sys.stderr)
        return 2
    recipe_part = dict(RECIPE_QUICK if args.quick else RECIPE)
    if args.arms is not None:
        recipe_part["arms"] = {arm: spec for arm, spec in RECIPE["arms"].items()
                               if arm == RECIPE["baseline"] or arm in args.arms}
    if args.seeds is not None:
        recipe_part["seeds"] = args.seeds
    if args.part in (None, "baseline") and not args.report_only:
        run_baseline(Path(args.out) / "baseline", quick=args.quick,
                     progress=not args.no_progress)
    if args.part in (None, "depth") and not args.report_only:
        run_depth(Path(args.out) / "depth", s, DEPTH_QUICK if args.quick else DEPTH,
                  progress=not args.no_progress)
    progress = not args.no_progress
    if args.part in (None, "designs"):
        run_designs(Path(args.out), s, report_only=args.report_only, progress=progress)
    if args.part in (None, "ngpt"):
        ngpt = {**s, **(NGPT_QUICK if args.quick else NGPT)}
        if args.designs is not None:
            ngpt["designs"] = args.designs
        run_designs(Path(args.out) / "ngpt", ngpt, report_only=args.report_only,
                    progress=progress)
    if args.part == "convergence":
        run_convergence(Path(args.out) / "convergence", s,
                        dict(CONVERGENCE_QUICK if args.quick else CONVERGENCE,
                             **({"seeds": args.seeds} if args.seeds else {}),
                             **({"steps": args.steps} if args.steps else {})),
                        progress=progress)
    if args.part == "recipe":
        run_recipe(Path(args.out) / "recipe", recipe_part, quick=args.quick,
                   report_only=args.report_only, progress=progress)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
