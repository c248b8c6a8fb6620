"""The ``svflow`` command line (also ``python -m svflow_jax``).

Subcommands:

* ``verify``: the main job. Runs every registered claim (:mod:`svflow_jax.claims`): exactness of
  every Transformer block variant against the flow solver it equals, orders of every registered
  solver and of the splittings, drift without retraction, Transformer stacks as depth grows
  (standard layer, pre-norm, Norm gains); writes ``summary.json``, CSV tables, PNG figures and
  ``report.md`` to ``--out``. Exit code 0 when every claim passes, 1 when one fails, 2 on bad
  options.
* ``sweep``: a step-size sweep of chosen solvers (registered names or ``package.module:Class``);
  resumable; exit code 1 when an order misses its expectation or cannot be fitted.
* ``inspect``: a real checkpoint on real text (:mod:`svflow_jax.inspection`): exactness of its
  flow, the geometry of its layers, smoothness of its weights in depth, refinement
  consistency; exit code 1 when its flow does not reproduce it.
* ``diagnose``: SVFlow diagnostics of a pretrained model under prefix shuffling
  (:mod:`svflow_jax.diagnose`); exit code 0 when the run completes, 2 on bad options.
* ``train``: train a solver as a layer design (:mod:`svflow_jax.training.cli`).

Options are checked before anything is compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import __version__
from .cli_types import int_at_least, nonnegative_int, positive_float, positive_int
from .xla_settings import use_project_flags


def _default_out(command: str) -> str:
    return str(Path("results") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}")


def _setup_jax(args: argparse.Namespace) -> str | None:
    """x64 must be on before any array exists (it stays on for float32 runs: their references
    are float64 solves, and every float32 array is asked for explicitly). The persistent
    compilation cache is on unless ``--no-compile-cache``. Returns the cache folder."""
    import jax

    jax.config.update("jax_enable_x64", True)
    if args.no_compile_cache:
        return None
    from .verify import enable_compilation_cache

    return str(enable_compilation_cache(args.cache_dir))


def _options(args: argparse.Namespace, parser: argparse.ArgumentParser, quick: bool = False):
    """The validated :class:`~svflow_jax.claims.Options`: explicit options win, ``--quick``
    fills in its small defaults, the rest are the library defaults."""
    from .claims import QUICK, Options

    names = ("seed", "dtype", "tokens", "dim", "layers", "t1", "strength", "repeats",
             "step_scale", "num_sizes")
    given = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    defaults = QUICK if quick else {}
    try:
        return Options(**{**defaults, **given})
    except ValueError as err:
        parser.error(str(err).replace("_", "-"))


def _verify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    options = _options(args, parser, quick=args.quick)
    from . import claims as claims_mod

    if args.list:
        for c in claims_mod.select():
            print(f"{c.name:<34} {c.statement}")
        return 0
    try:
        chosen = claims_mod.select(args.only)
    except ValueError as err:
        parser.error(str(err))
    cache = _setup_jax(args)
    from tqdm import tqdm

    from . import report, verify

    out = Path(args.out or _default_out("verify"))
    with tqdm(total=len(chosen), desc="svflow verify", unit="claim",
              disable=args.no_progress) as bar:
        def tick(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update(1)

        jobs = args.jobs or ((os.cpu_count() or 1) if args.quick else 1)
        results, compile_info = verify.run(options, chosen, progress=tick, workers=jobs)
    summary = verify.summary(results, options, compile_info,
                             {"quick": args.quick, "only": args.only, "out": str(out),
                              "compile_cache": cache, "jobs": jobs,
                              "xla_flags": os.environ.get("XLA_FLAGS", "")})
    report.write_all(out, summary)
    _print_verify(summary, out)
    return 0 if summary["passed"] else 1


def _print_verify(summary: dict, out: Path) -> None:
    from .report import headline, verdict

    print(f"\n{'claim':<34} {'figure':<34} result")
    for c in summary["claims"]:
        print(f"{c['name']:<34} {headline(c):<34} {verdict(c['passed'])}")
    comp = summary["compile"]
    overall = "PASSED" if summary["passed"] else "FAILED"
    print(f"\n{overall}: {len(summary['claims'])} claims in {comp['total_s']:.1f} s "
          f"({comp['xla_compilations']} XLA compilations, {comp['cache_hits']} cached; "
          f"{comp['compile_total_s']:.1f} of {comp['busy_s']:.1f} thread-seconds tracing and "
          f"compiling); report: {out / 'report.md'}")


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def _sweep(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    options = _options(args, parser)
    from .solvers.registry import get_solver

    specs = []
    for name in args.solvers:
        try:
            specs.append(get_solver(name))
        except ValueError as err:
            parser.error(f"--solvers: {err}")
    if args.steps:
        first, last = args.steps
        num = args.num_sizes or options.num_sizes or 8
        if not first < last:
            parser.error(f"--steps FIRST LAST needs FIRST < LAST, got {first} {last}")
        if num > last - first + 1:
            parser.error(f"--num-sizes {num} distinct step counts do not fit in "
                         f"[{first}, {last}]")
    if args.num_sizes is not None and args.num_sizes < 3:
        parser.error("--num-sizes must be >= 3 to fit an order")
    cache = _setup_jax(args)
    from tqdm import tqdm

    from .claims import Context, solver_sweep
    from .environment import environment
    from .report import verdict

    out = Path(args.out or _default_out("sweep"))
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items()
              if k not in ("run", "no_progress", "out", "no_compile_cache", "cache_dir")}
    config_path = out / "config.json"
    if config_path.exists() and json.loads(config_path.read_text()) != config:
        print(f"svflow sweep: {out} holds a sweep with another configuration; choose another "
              "--out", file=sys.stderr)
        return 2
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    ctx = Context(options)
    rows = []
    for spec in tqdm(specs, desc="svflow sweep", unit="solver", disable=args.no_progress):
        path = out / f"{_slug(spec.name)}.json"
        if path.exists():  # resume: this solver is done
            rows.append(json.loads(path.read_text()))
            continue
        evidence = solver_sweep(ctx, spec, tuple(args.steps) if args.steps else None,
                                args.num_sizes)
        row = {"passed": evidence.passed, "tolerance": evidence.tolerance,
               **evidence.figures, "points": evidence.rows, "environment": environment()}
        path.write_text(json.dumps(row, indent=2) + "\n")
        rows.append(row)
    for r in rows:
        lo, hi = r["order_ci"]
        print(f"{r['solver']:<24} expected {r['expected_order']}  fitted "
              f"{r['fitted_order']:.2f}  95% [{lo:.2f}, {hi:.2f}]  {r['fit_points']} points  "
              f"{verdict(r['passed'])}")
    print(f"results in {out}" + (f" (compilation cache: {cache})" if cache else ""))
    return 0 if all(r["passed"] is True for r in rows) else 1


def _inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import dataclasses

    from .inspection import QUICK, InspectOptions

    given = {k: (tuple(v) if isinstance(v, list) else v) for k in (
        "windows", "window", "substeps", "schemes", "exactness_tokens")
        if (v := getattr(args, k)) is not None}
    try:
        options = InspectOptions(**{**(QUICK if args.quick else {}), **given})
    except ValueError as err:
        parser.error(str(err).replace("_", "-"))
    if args.text is not None and not Path(args.text).is_file():
        parser.error(f"--text {args.text}: no such file")
    cache = _setup_jax(args)
    from tqdm import tqdm

    from . import inspection
    from .data import emma_opening
    from .environment import environment
    from .inspection_report import SCHEMA_VERSION, write_inspection

    text = Path(args.text).read_text(encoding="utf-8") if args.text else emma_opening()
    source = args.text or "svflow_jax/data/emma_opening.txt (Jane Austen, Emma, opening)"
    start = time.perf_counter()
    try:
        loaded = inspection.resolve_model(args.model)
        inspection.token_windows(loaded.tokenizer, text, options.windows, options.window)
    except (ValueError, RuntimeError) as err:
        parser.error(str(err))
    steps = 4 + 1 + len(options.substeps) + len(options.schemes) if loaded.config.lm_head else 4
    out = Path(args.out or _default_out("inspect"))
    with tqdm(total=steps, desc="svflow inspect", unit="step",
              disable=args.no_progress) as bar:
        def tick(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update(1)

        results = inspection.inspect_model(loaded, text, options, progress=tick)
    summary = {"schema_version": SCHEMA_VERSION, "model": args.model,
               "config": {k: (str(v) if not isinstance(v, (int, float, str, bool, type(None)))
                              else v) for k, v in dataclasses.asdict(loaded.config).items()},
               "options": dataclasses.asdict(options),
               "text": {"source": source, "characters": len(text)},
               "compile_cache": cache, "quick": args.quick,
               "results": [r.to_json() for r in results],
               "seconds": time.perf_counter() - start, "environment": environment()}
    write_inspection(out, summary)
    failed = [r.name for r in results if r.passed is False]
    for r in results:
        verdict = {True: "PASS", False: "FAIL", None: "-"}[r.passed]
        print(f"{r.name:<18} {verdict:<5} {r.seconds:6.1f} s")
    print(f"report: {out / 'report.md'}")
    return 1 if failed else 0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="output folder (default: results/<command>-<time>)")
    p.add_argument("--seed", type=nonnegative_int, help="random seed, >= 0 (default 0)")
    p.add_argument("--dtype", choices=("float64", "float32"),
                   help="floating-point type of states and parameters (default float64)")
    p.add_argument("--tokens", type=positive_int, help="number of tokens n (default 8)")
    p.add_argument("--dim", type=positive_int,
                   help="dimension d of R^d, even, >= 2 (default 16)")
    p.add_argument("--t1", type=positive_float, help="final time T (default 1)")
    p.add_argument("--strength", type=positive_float,
                   help="scale of the random weights: the speed of the flow (default 1)")
    p.add_argument("--repeats", type=positive_int,
                   help="timed repetitions per solve; the median is reported (default 3)")
    p.add_argument("--num-sizes", type=positive_int,
                   help="step sizes per solver sweep, >= 3 (default: per solver)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use JAX's persistent compilation cache")
    p.add_argument("--cache-dir", help="compilation cache folder (default: $SVFLOW_CACHE_DIR, "
                   "else ~/.cache/svflow-jax/xla)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="svflow",
        description="Score-based Variational Flow on the sphere: a Transformer is an Euler step.",
    )
    parser.add_argument("--version", action="version", version=f"svflow-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify", help="the main job: check the paper's claim with numbers",
        description="Runs every registered claim on a random SVFlow with a smooth theta(t) "
        "(nothing downloaded): exactness of every block variant, orders of every registered "
        "solver and splitting, drift, Transformer stacks as depth grows. Writes summary.json, "
        "CSV, PNG and report.md to --out. Exit code 0: every claim passed; 1: a claim failed; "
        "2: bad options.",
    )
    _add_common(verify)
    verify.add_argument("--layers", type=positive_int,
                        help="depth of the Transformers of the exactness claims (default 8)")
    verify.add_argument("--step-scale", type=positive_float,
                        help="multiply every sweep's step counts (default 1)")
    verify.add_argument("--quick", action="store_true",
                        help="small defaults (n=4, d=8, 4 layers, depths 16..64, 1 timing "
                        "repeat, claims in parallel); explicit options still win")
    verify.add_argument("--jobs", type=positive_int,
                        help="claims run at once, in threads (default 1; --quick: one per CPU "
                        "core, which overlaps compilation but shares the machine between the "
                        "claims' timings)")
    verify.add_argument("--only", nargs="+", metavar="PREFIX",
                        help="run only the claims whose name starts with PREFIX")
    verify.add_argument("--list", action="store_true", help="list the claims and exit")
    verify.set_defaults(run=_verify)

    sweep = sub.add_parser(
        "sweep", help="a step-size sweep of chosen solvers (resumable)",
        description="Step-size sweep on the random smooth SVFlow. A solver is a name of the "
        "solver catalogue (svflow_jax.solvers.catalogue) or an import path package.module:Attr "
        "naming a Method, a ButcherTableau, a solver class or a factory (the current folder is "
        "searched first). One JSON per solver in --out, so an "
        "interrupted sweep resumes. Exit code 1 when an order misses its expectation or "
        "cannot be fitted.",
    )
    _add_common(sweep)
    from .solvers import catalogue

    sweep.add_argument("--solvers", "--solver", nargs="+", default=["euler", "heun", "rk4"],
                       help="methods of the solver catalogue ("
                       f"{', '.join(catalogue.names(splitting=False))}) or package.module:Attr "
                       "(default: euler heun rk4)")
    sweep.add_argument("--steps", type=positive_int, nargs=2, metavar=("FIRST", "LAST"),
                       help="first and last number of steps (default: per solver)")
    sweep.set_defaults(run=_sweep)

    inspect = sub.add_parser(
        "inspect", help="how close is a real pretrained model to the solution of its ODE?",
        description="Loads a real checkpoint (a packaged name such as smollm2-135m-instruct or "
        "all-minilm-l6-v2, a Hugging Face folder, or a GGUF file) and measures on real text: "
        "whether its own flow reproduces every hidden state (float64, float32), how each "
        "layer moves the tokens, how smooth the weights are in depth, and how the next-token "
        "loss and the final states change when the same flow is integrated with Euler "
        "sub-steps, Heun and RK4 per layer. Writes summary.json, CSV, PNG and report.md to "
        "--out. Exit code 0: done (and exact where a flow exists); 1: the flow does not "
        "reproduce the model; 2: bad options.",
    )
    inspect.add_argument("model", help="packaged model name, Hugging Face folder or GGUF file")
    inspect.add_argument("--text", help="UTF-8 text file (default: the opening of Emma, "
                         "shipped with the package)")
    inspect.add_argument("--windows", type=positive_int, help="text windows (default 8)")
    inspect.add_argument("--window", type=int_at_least(2),
                         help="tokens per window (default 128)")
    inspect.add_argument("--substeps", type=int_at_least(2),
                         nargs="+", help="Euler sub-steps per layer (default 2 4 8)")
    from .inspection import scheme_names

    inspect.add_argument("--schemes", nargs="*", choices=scheme_names(),
                         help="higher-order methods of the solver catalogue per layer (default "
                         "heun rk4)")
    inspect.add_argument("--exactness-tokens", type=positive_int,
                         help="tokens of the float64/float32 exactness check (default 64)")
    inspect.add_argument("--quick", action="store_true",
                         help="1 window of 24 tokens, sub-steps 2 4, 16 exactness tokens")
    inspect.add_argument("--out", help="output folder (default: results/inspect-<time>)")
    inspect.add_argument("--no-progress", action="store_true", help="no progress bar")
    inspect.add_argument("--no-compile-cache", action="store_true",
                         help="do not use JAX's persistent compilation cache")
    inspect.add_argument("--cache-dir", help="compilation cache folder")
    inspect.set_defaults(run=_inspect)
    from .diagnose.cli import add_diagnose_parser

    add_diagnose_parser(sub)
    from .training.cli import add_train_parser  # svflow train (svflow_jax/training/cli.py)

    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # svflow_jax.xla_settings: before JAX starts its CPU client; a user's XLA_FLAGS win
    use_project_flags(quick=args.command == "verify" and args.quick)
    sub = parser._subparsers._group_actions[0].choices[args.command]  # for error messages
    return args.run(args, sub)


if __name__ == "__main__":
    raise SystemExit(main())
