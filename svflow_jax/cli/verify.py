"""``svflow verify``: every registered claim on a random SVFlow with a smooth ``theta(t)``
(:mod:`svflow_jax.claims`), written as ``summary.json``, CSV tables, PNG figures and
``report.md`` (:mod:`svflow_jax.claims.report`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from . import runtime
from .common import (
    MAX_LAYERS,
    add_flow_options,
    add_run_options,
    flow_options,
    resolve_methods,
    subcommand,
)
from .types import positive_float, positive_int

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subcommand(
        subparsers, "verify", help="the main job: check the paper's claim with numbers",
        description="Runs every registered claim on a random SVFlow with a smooth theta(t) "
        "(nothing downloaded): exactness of every block variant, orders of every method of the "
        "solver catalogue and of the splittings, drift, Transformer stacks as depth grows; "
        "with --methods the orders of a user's methods too. Writes summary.json, CSV, PNG and "
        "report.md to --out.")
    add_flow_options(p)
    add_run_options(p, "verify")
    p.add_argument("--layers", type=positive_int,
                   help="depth of the Transformers of the exactness claims, at most "
                   f"{MAX_LAYERS} (default 8)")
    p.add_argument("--step-scale", type=positive_float,
                   help="multiply every sweep's step counts (default 1)")
    p.add_argument("--quick", action="store_true",
                   help="small defaults (n=4, d=8, 4 layers, depths 16..64, 1 timing "
                   "repeat, claims in parallel); explicit options still win")
    p.add_argument("--jobs", type=positive_int,
                   help="claims run at once, in threads (default 1; --quick: one per CPU "
                   "core, which overlaps compilation but shares the machine between the "
                   "claims' timings)")
    p.add_argument("--methods", nargs="+", metavar="METHOD",
                   help="also verify the order of these methods: package.module:Attr naming a "
                   "Method, a ButcherTableau, a solver class or a factory (the current folder "
                   "is searched first) adds its claim order/<name>; a name of the solver "
                   "catalogue is verified anyway")
    p.add_argument("--only", nargs="+", metavar="PREFIX",
                   help="run only the claims whose name starts with PREFIX")
    p.add_argument("--list", action="store_true", help="list the claims and exit")
    p.set_defaults(run=run)
    return p


#: XLA programs that ``svflow verify`` compiles on an empty cache: 58 for the 42 registered
#: claims, at the default sizes and with ``--quick`` alike (the claims share their programs);
#: the line before the first compilation scales it to the claims chosen
PROGRAMS = 58


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import catalog

    if args.list and not args.methods:  # the registry's names, without JAX
        print("\n".join(catalog.claim_lines()))
        return runtime.EXIT_OK
    options = flow_options(args, quick=args.quick)  # no JAX yet
    if args.methods:  # a user's module is imported (and JAX with it); names checked first
        from .. import claims as claims_mod

        extra = _method_claims(args.methods)
        try:
            chosen = claims_mod.select(None if args.list else args.only, extra)
        except ValueError as err:
            raise runtime.UsageError(str(err)) from None
        if args.list:
            for c in chosen:
                print(f"{c.name:<34} {c.statement}")
            return runtime.EXIT_OK
        names = [c.name for c in chosen]
    else:
        if args.only:
            catalog.check_claim_prefixes(args.only)
        names = [name for name, _ in catalog.claims()
                 if not args.only or any(name.startswith(p) for p in args.only)]
    out = Path(args.out or runtime.default_out("verify"))
    args.out_folder = runtime.prepare_out(out, "verify", overwrite=args.overwrite)
    cache = runtime.setup_jax(args)
    runtime.announce_compiling(parser.prog, max(1, round(PROGRAMS * len(names)
                                                         / len(catalog.CLAIMS))), cache)
    from .. import claims as claims_mod
    from ..claims import report
    from ..claims import run as verify
    from ..reporting import display_path

    if not args.methods:
        chosen = claims_mod.select(args.only)
    with runtime.progress_bar("svflow verify", "claim", args.no_progress, len(chosen)) as (tick, _):
        jobs = args.jobs or ((os.cpu_count() or 1) if args.quick else 1)
        results, compile_info = verify.run(options, chosen, progress=tick, workers=jobs)
    summary = verify.summary(results, options, compile_info,
                             {"quick": args.quick, "only": args.only, "out": display_path(out),
                              "compile_cache": cache is not None, "jobs": jobs,
                              "xla_flags": os.environ.get("XLA_FLAGS", "")})
    report.write_all(out, summary)
    args.out_folder.finish()
    _print(summary, out)
    return runtime.EXIT_OK if summary["passed"] else runtime.EXIT_FAILED


def _method_claims(names) -> list:
    """The claims ``order/<name>`` of the ``--methods`` the catalogue does not hold (its own
    are registered claims already)."""
    from ..claims import order_claim
    from ..solvers import catalogue

    claims = []
    for name, method in zip(names, resolve_methods(names, "--methods"), strict=True):
        if catalogue.CATALOGUE.get(method.name) is method:
            continue
        try:
            claims.append(order_claim(method))
        except ValueError as err:
            raise runtime.UsageError(f"--methods {name}: {err}") from None
    return claims


def _print(summary: dict, out: Path) -> None:
    from ..claims.report import headline, verdict

    print(f"\n{'claim':<34} {'figure':<34} result")
    for c in summary["claims"]:
        print(f"{c['name']:<34} {headline(c):<34} {verdict(c['passed'])}")
    comp = summary["compile"]
    overall = "PASSED" if summary["passed"] else "FAILED"
    print(f"\n{overall}: {len(summary['claims'])} claims in {comp['total_s']:.1f} s "
          f"({comp['xla_compilations']} XLA compilations, {comp['cache_hits']} cached; "
          f"{comp['compile_total_s']:.1f} of {comp['busy_s']:.1f} thread-seconds tracing and "
          f"compiling); report: {out / 'report.md'}")
