"""``svflow sweep``: a step-size sweep of chosen methods of the solver catalogue (or of a
user's, named ``package.module:Attr``), one JSON per method in ``--out`` so that an
interrupted sweep resumes; then ``convergence.png`` (error against step size, log-log, the
fitted orders in the legend) and ``report.md`` (a verdict line per method, then the table:
:func:`svflow_jax.claims.report.write_sweep`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..reporting import write_json
from . import runtime
from .common import add_flow_options, add_run_options, flow_options, resolve_methods, subcommand
from .types import positive_int

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subcommand(
        subparsers, "sweep", help="a step-size sweep of chosen methods (resumable)",
        description="Step-size sweep on the random smooth SVFlow. A method is a name of the "
        "solver catalogue (svflow_jax.solvers.catalogue) or an import path package.module:Attr "
        "naming a Method, a ButcherTableau, a solver class or a factory (the current folder is "
        "searched first). One JSON per method in --out, so an interrupted sweep resumes; exit "
        "code 1 when an order misses its expectation or cannot be fitted.")
    add_flow_options(p)
    add_run_options(p, "sweep")
    p.add_argument("--methods", nargs="+", default=["euler", "heun", "rk4"], metavar="METHOD",
                   help="methods of the solver catalogue (svflow train --list-methods lists "
                   "them; the splittings take two fields and are verify's) or "
                   "package.module:Attr (default: euler heun rk4)")
    p.add_argument("--steps", type=positive_int, nargs=2, metavar=("FIRST", "LAST"),
                   help=f"first and last number of steps, at most {runtime.MAX_STEPS} "
                   "(default: per solver)")
    p.set_defaults(run=run)
    return p


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .catalog import check_methods

    options = flow_options(args)  # every check before JAX is imported
    check_methods(args.methods, "--methods")
    if args.num_sizes is not None and args.num_sizes < 3:
        raise runtime.UsageError("--num-sizes must be >= 3 to fit an order")
    if args.steps:
        first, last = args.steps
        num = args.num_sizes or options.num_sizes or 8
        if not first < last:
            raise runtime.UsageError(f"--steps FIRST LAST needs FIRST < LAST, got {first} {last}")
        if last > runtime.MAX_STEPS:
            raise runtime.UsageError(f"--steps {first} {last}: at most {runtime.MAX_STEPS} "
                                     "steps per solve")
        if num > last - first + 1:
            raise runtime.UsageError(f"--num-sizes {num} distinct step counts do not fit in "
                                     f"[{first}, {last}]")
    out = Path(args.out or runtime.default_out("sweep"))
    config = {k: v for k, v in vars(args).items()
              if k not in ("run", "no_progress", "out", "no_compile_cache", "cache_dir",
                           "overwrite", "out_folder", "argv")}
    args.out_folder = runtime.prepare_out(out, "sweep", overwrite=args.overwrite, resumable=True)
    config_path = out / "config.json"  # (an earlier sweep's: prepare_out refuses any other)
    if config_path.is_file():
        try:
            earlier = json.loads(config_path.read_text())
        except ValueError:
            earlier = None
        if earlier != config:
            raise runtime.UsageError(f"--out {out}: it holds a sweep with another configuration; "
                                     "choose another --out")
    specs = resolve_methods(args.methods, "--methods")  # imports JAX (and a user's module)
    write_json(config_path, config)
    cache = runtime.setup_jax(args)
    todo = [s.name for s in specs if not (out / f"{_slug(s.name)}.json").exists()]
    if todo:  # measured: the problem and its reference 6 programs, each method's sweep 2
        runtime.announce_compiling(parser.prog, 6 + 2 * len(todo), cache)
    from tqdm import tqdm

    from ..claims import Context, solver_sweep
    from ..claims.report import write_sweep
    from ..environment import environment
    from ..reporting import fmt, verdict

    ctx = Context(options)
    rows = []
    try:
        for spec in tqdm(specs, desc="svflow sweep", unit="method", disable=args.no_progress):
            rows.append(_sweep(ctx, spec, out / f"{_slug(spec.name)}.json", args,
                               solver_sweep, environment))
    except KeyboardInterrupt:
        raise runtime.Interrupted(
            f"interrupted after {len(rows)} of {len(specs)} methods (their results are kept "
            f"in {out}); resume with: {runtime.command_line(args, out)}") from None
    write_sweep(out, rows)
    args.out_folder.finish()
    for r in rows:
        lo, hi = r["order_ci"]
        print(f"{r['solver']:<24} expected {r['expected_order']}  fitted "
              f"{fmt(r['fitted_order'])}  95% [{fmt(lo)}, {fmt(hi)}]  {r['fit_points']} "
              f"points  {verdict(r['passed'])}")
    print(f"report: {out / 'report.md'}, figure: {out / 'convergence.png'}"
          + (f" (compilation cache: {cache})" if cache else ""))
    return runtime.EXIT_OK if all(r["passed"] is True for r in rows) else runtime.EXIT_FAILED


def _sweep(ctx, spec, path: Path, args: argparse.Namespace, solver_sweep, environment) -> dict:
    """One method's row: read from its JSON file when an earlier run wrote it (resume), else
    measured and written (atomically: a kill leaves no half-written file to resume from)."""
    if path.exists():
        try:
            return json.loads(path.read_text())
        except ValueError:  # damaged: measured again
            path.unlink()
    evidence = solver_sweep(ctx, spec, tuple(args.steps) if args.steps else None,
                            args.num_sizes)
    row = {"passed": evidence.passed, "tolerance": evidence.tolerance,
           **evidence.figures, "points": evidence.rows, "environment": environment()}
    write_json(path, row)
    return row
