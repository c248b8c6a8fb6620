"""The ``svflow`` command line (also ``python -m svflow_jax``).

Subcommands:

* ``verify``: the main job. Exactness of every Transformer block variant against the flow
  solver it equals, step-size sweeps of eight solvers with fitted orders, work-precision,
  drift without retraction, and pre-norm against post-norm; writes ``summary.json``, CSV
  tables, PNG figures and ``report.md`` to ``--out``; exits non-zero when a claim fails.
* ``sweep``: a custom step-size sweep (chosen solvers, sizes, step counts); resumable.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _setup_jax() -> None:
    """x64 must be switched on before any array exists. It stays on for float32 runs too:
    their references are float64 solves, and every float32 array is asked for explicitly."""
    import jax

    jax.config.update("jax_enable_x64", True)


def _default_out(command: str) -> str:
    return str(Path("results") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}")


def _problem_options(args: argparse.Namespace) -> dict:
    return dict(seed=args.seed, n=args.tokens, d=args.dim, t1=args.t1, strength=args.strength)


def _verify(args: argparse.Namespace) -> int:
    _setup_jax()
    import jax.numpy as jnp
    from tqdm import tqdm

    from . import report, verify

    dtype = jnp.float64 if args.dtype == "float64" else jnp.float32
    out = Path(args.out or _default_out("verify"))
    names = list(verify.SOLVERS)
    tasks = len(verify.EXACTNESS_VARIANTS) + 2 * len(names) + 2
    start = time.perf_counter()
    timings = {}
    with tqdm(total=tasks, desc="svflow verify", unit="task", disable=args.no_progress) as bar:
        def tick(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        t = time.perf_counter()
        exactness = verify.exactness_table(seed=args.seed, n=args.tokens, d=args.dim,
                                           layers=args.layers, dtype=dtype, progress=tick)
        timings["exactness_s"] = time.perf_counter() - t
        t = time.perf_counter()
        problem = verify.smooth_problem(dtype=dtype, **_problem_options(args))
        reference = verify.reference_solution(problem)
        tick("reference")
        timings["reference_s"] = time.perf_counter() - t
        t = time.perf_counter()
        convergence = verify.convergence_sweep(problem, names, reference, repeats=args.repeats,
                                               progress=tick, scale_steps=args.step_scale)
        timings["convergence_s"] = time.perf_counter() - t
        t = time.perf_counter()
        drift = verify.drift_sweep(problem, names, progress=tick, convergence=convergence)
        timings["drift_s"] = time.perf_counter() - t
        t = time.perf_counter()
        prepost = verify.prenorm_vs_postnorm(problem, reference, seed=args.seed)
        tick("pre/post-norm")
        timings["prenorm_vs_postnorm_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - start

    # A solver whose order float32 round-off cannot resolve has passed = None (not a failure).
    passed = (all(r["passed"] for r in exactness)
              and all(r["passed"] is not False for r in convergence) and prepost["passed"])
    config = {k: v for k, v in vars(args).items() if k not in ("run", "no_progress")}
    config["out"] = str(out)
    summary = {
        "schema_version": report.SCHEMA_VERSION,
        "passed": passed,
        "config": {**config, "reference_tolerance": verify.REFERENCE_TOLERANCE,
                   "fit_floor": verify.fit_floor(dtype), "fit_ceiling": verify.FIT_CEILING,
                   "min_steps_in_fit": verify.MIN_STEPS_IN_FIT},
        "exactness": exactness,
        "convergence": convergence,
        "drift": drift,
        "prenorm_vs_postnorm": prepost,
        "timings": timings,
    }
    report.write_all(out, summary, config)
    _print_verify(summary, out)
    return 0 if passed else 1


def _print_verify(summary: dict, out: Path) -> None:
    print(f"\n{'variant':<20} {'max abs diff':>13} {'tolerance':>10}  result")
    for r in summary["exactness"]:
        print(f"{r['variant']:<20} {r['max_abs_diff']:>13.2e} {r['tolerance']:>10.1e}  "
              f"{'PASS' if r['passed'] else 'FAIL'}")
    print(f"\n{'solver':<17} {'expected':>8} {'fitted':>7} {'95% interval':>17} {'pts':>4}  result")
    for r in summary["convergence"]:
        lo, hi = r["order_ci"]
        print(f"{r['solver']:<17} {r['expected_order']:>8} {r['fitted_order']:>7.2f} "
              f"  [{lo:6.2f}, {hi:6.2f}] {r['fit_points']:>4}  {_verdict(r['passed'])}")
    pp = summary["prenorm_vs_postnorm"]
    print(f"\npost-norm order {pp['postnorm_order']:.2f}; pre-norm error at the finest step "
          f"{pp['prenorm_error_finest']:.3g} (no convergence to the spherical flow): "
          f"{'PASS' if pp['passed'] else 'FAIL'}")
    verdict = "PASSED" if summary["passed"] else "FAILED"
    print(f"\n{verdict} in {summary['timings']['total_s']:.1f} s; report: {out / 'report.md'}")


def _verdict(passed: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "UNRESOLVED (round-off)"}[passed]


def _sweep(args: argparse.Namespace) -> int:
    _setup_jax()
    import json

    import jax.numpy as jnp
    from tqdm import tqdm

    from . import verify

    unknown = [s for s in args.solvers if s not in verify.SOLVERS]
    if unknown:
        print(f"svflow sweep: unknown solver(s) {unknown}; choose from {list(verify.SOLVERS)}",
              file=sys.stderr)
        return 2
    dtype = jnp.float64 if args.dtype == "float64" else jnp.float32
    out = Path(args.out or _default_out("sweep"))
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("run", "no_progress", "out")}
    config_path = out / "config.json"
    if config_path.exists() and json.loads(config_path.read_text()) != config:
        print(f"svflow sweep: {out} holds a sweep with another configuration; choose another "
              "--out", file=sys.stderr)
        return 2
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    problem = verify.smooth_problem(dtype=dtype, **_problem_options(args))
    reference = verify.reference_solution(problem)
    rows = []
    for name in tqdm(args.solvers, desc="svflow sweep", unit="solver",
                     disable=args.no_progress):
        path = out / f"{name}.json"
        if path.exists():  # resume: this solver is done
            rows.append(json.loads(path.read_text()))
            continue
        row = verify.convergence_sweep(problem, [name], reference, repeats=args.repeats,
                                       num_sizes=args.num_sizes,
                                       step_range=tuple(args.steps) if args.steps else None)[0]
        path.write_text(json.dumps(row, indent=2) + "\n")
        rows.append(row)
    for r in rows:
        print(f"{r['solver']:<17} expected {r['expected_order']}  fitted "
              f"{r['fitted_order']:.2f}  95% [{r['order_ci'][0]:.2f}, {r['order_ci'][1]:.2f}]")
    print(f"results in {out}")
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="output folder (default: results/<command>-<time>)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                   help="floating-point type of states and parameters (default float64)")
    p.add_argument("--tokens", type=int, default=8, help="number of tokens n (default 8)")
    p.add_argument("--dim", type=int, default=16, help="dimension d of R^d (default 16)")
    p.add_argument("--t1", type=float, default=1.0, help="final time T (default 1)")
    p.add_argument("--strength", type=float, default=1.0,
                   help="scale of the random scores: the speed of the flow (default 1)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repetitions per solve; the median is reported (default 3)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="svflow",
        description="Score-based Variational Flow on the sphere: a Transformer is an Euler step.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify", help="the main job: check the paper's claim with numbers",
        description="Exactness of every block variant, step-size sweeps with fitted orders, "
        "work-precision, drift and pre-norm vs post-norm, on a random SVFlow with a smooth "
        "theta(t) (nothing downloaded). Writes summary.json, CSV, PNG and report.md to --out; "
        "exits 1 when a claim fails.",
    )
    _add_common(verify)
    verify.add_argument("--layers", type=int, default=8,
                        help="depth of the Transformers of the exactness table (default 8)")
    verify.add_argument("--step-scale", type=float, default=1.0,
                        help="multiply every sweep's step counts (default 1)")
    verify.add_argument("--quick", action="store_true",
                        help="small sizes (n=4, d=8, 4 layers, 1 timing repeat): a smoke run")
    verify.set_defaults(run=_verify)

    sweep = sub.add_parser(
        "sweep", help="a custom step-size sweep (resumable)",
        description="Step-size sweep of the chosen solvers on the random smooth SVFlow; one "
        "JSON per solver in --out, so an interrupted sweep resumes where it stopped.",
    )
    _add_common(sweep)
    sweep.add_argument("--solvers", nargs="+", default=["euler", "heun", "rk4"],
                       help="solvers to sweep (default: euler heun rk4); any of: euler, heun, "
                       "midpoint, rk4, tsit5, dopri8, geodesic-euler, crouch-grossman3")
    sweep.add_argument("--steps", type=int, nargs=2, metavar=("FIRST", "LAST"),
                       help="first and last number of steps (default: per solver)")
    sweep.add_argument("--num-sizes", type=int, default=None,
                       help="step sizes per solver (default 8; tsit5 12, dopri8 16)")
    sweep.set_defaults(run=_sweep)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "quick", False):
        args.tokens, args.dim, args.layers, args.repeats = 4, 8, 4, 1
    if getattr(args, "dim", 2) < 2:
        parser.error("--dim must be >= 2 (the sphere S^(d-1) needs d >= 2)")
    if getattr(args, "steps", None) and not 1 <= args.steps[0] < args.steps[1]:
        parser.error("--steps FIRST LAST needs 1 <= FIRST < LAST")
    for name in ("tokens", "layers", "repeats", "num_sizes"):
        if (getattr(args, name, 1) or 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(args, "t1", 1.0) <= 0 or getattr(args, "strength", 1.0) <= 0:
        parser.error("--t1 and --strength must be positive")
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
