"""``svflow inspect MODEL``: how close is a real pretrained Transformer to the solution of its
ODE (:mod:`svflow_jax.inspection`), written by :mod:`svflow_jax.inspection.report`."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from . import runtime
from .common import add_run_options, check_model, option_error, subcommand
from .types import int_at_least, positive_int, step_multiplier

__all__ = ["add_parser", "run", "MAX_SUBSTEPS"]

#: most Euler sub-steps per layer (``--substeps``): each solve costs that many times the
#: model's own forward pass, on every window
MAX_SUBSTEPS = 1024

#: the fields of :class:`~svflow_jax.inspection.config.InspectOptions` the options set
OPTIONS = {"windows": "--windows", "window": "--window", "substeps": "--substeps",
           "schemes": "--methods", "exactness_tokens": "--exactness-tokens"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subcommand(
        subparsers, "inspect", help="how close is a real pretrained model to the solution of "
        "its ODE?",
        description="Loads a real checkpoint (a packaged name such as smollm2-135m-instruct or "
        "all-minilm-l6-v2, a Hugging Face folder, or a GGUF file) and measures on real text: "
        "whether its own flow reproduces every hidden state (float64, float32), how each "
        "layer moves the tokens, how smooth the weights are in depth, and how the next-token "
        "loss and the final states change when the same flow is integrated with Euler "
        "sub-steps and higher-order methods per layer; the step-size sweep (every layer's step "
        "h scaled by alpha, globally, one layer at a time and along linear profiles, "
        "integrated by Euler and other methods); with --lens the logit lens after every "
        "sub-step and the exact decomposition of the logits into the embedding's and each "
        "branch's contributions. Writes summary.json, CSV, PNG and report.md to --out. Exit "
        "code 1: the flow does not reproduce the model.")
    p.add_argument("model", help="packaged model name, Hugging Face folder or GGUF file")
    p.add_argument("--text", help="UTF-8 text file (default: the opening of Emma, "
                   "shipped with the package)")
    p.add_argument("--windows", type=positive_int, help="text windows (default 8)")
    p.add_argument("--window", type=int_at_least(2), help="tokens per window (default 128)")
    p.add_argument("--substeps", type=int_at_least(2), nargs="+",
                   help=f"Euler sub-steps per layer, at most {MAX_SUBSTEPS} (default 2 4 8)")
    p.add_argument("--methods", nargs="*", metavar="METHOD",
                   help="higher-order methods per layer: methods of the solver catalogue with "
                   "a step in R^d (svflow train --list-methods lists them) or "
                   "package.module:Attr (default heun rk4)")
    p.add_argument("--exactness-tokens", type=positive_int,
                   help="tokens of the float64/float32 exactness check (default 64)")
    p.add_argument("--alphas", type=step_multiplier, nargs="+", metavar="ALPHA",
                   help="global step multipliers of the step-size sweep, including 1 (default "
                   "0.5 0.8 0.9 1 1.1 1.2 1.5)")
    p.add_argument("--alpha-methods", nargs="+", metavar="METHOD",
                   help="methods of the step-size sweep, each inside the model's own block "
                   "structure (split) and on the sum field (sum; euler/sum is the "
                   "parallel-Euler control), a splitting in both orderings: euler (the "
                   "model's own), methods of the solver catalogue with a step in R^d or "
                   "package.module:Attr (default euler heun rk4 strang)")
    p.add_argument("--layer-alphas", type=step_multiplier, nargs="*", metavar="ALPHA",
                   help="multipliers applied to one layer at a time, 0 removing it (default "
                   "0 0.5 1.5; none: skip)")
    p.add_argument("--fit-profile", type=int_at_least(0), metavar="STEPS",
                   help="fit one alpha per layer by STEPS Adam steps on the sweep's windows "
                   "and score it on as many held-out windows of the other Austen novels, "
                   "beside the global alpha 0.9 and a 1/sqrt(l) profile (default 0: off; each "
                   "step is one forward and one backward pass, about 3 forward passes)")
    p.add_argument("--no-alpha-sweep", action="store_true", help="skip the step-size sweep")
    p.add_argument("--lens", action="store_true",
                   help="the logit lens and the exact logit decomposition (on by --quick)")
    p.add_argument("--quick", action="store_true",
                   help="2 windows of 24 tokens, sub-steps 2 4, 16 exactness tokens, a small "
                   "step-size sweep (alpha 0.5 1 1.5; euler heun rk4 strang; removals; the "
                   "derivative; no fit), the lens")
    add_run_options(p, "inspect")
    p.set_defaults(run=run)
    return p


def alpha_options(args: argparse.Namespace, quick_default):
    """The step-size sweep's grid from ``--alphas``, ``--alpha-methods``, ``--layer-alphas``
    (``None`` with ``--no-alpha-sweep``); ``quick_default`` fills in what is not given."""
    if args.no_alpha_sweep:
        return None
    from ..inspection.config import AlphaOptions

    given: dict = {k: tuple(v) for k, v in (("alphas", args.alphas),
                                            ("schemes", args.alpha_methods),
                                            ("layer_alphas", args.layer_alphas)) if v is not None}
    if args.fit_profile is not None:
        given["fit_steps"] = args.fit_profile
    base = dataclasses.asdict(quick_default) if quick_default is not None else {}
    try:
        return AlphaOptions(**{**base, **given})
    except ValueError as err:
        raise option_error(err, {"alphas": "--alphas", "schemes": "--alpha-methods",
                                 "layer_alphas": "--layer-alphas",
                                 "fit_steps": "--fit-profile"}) from None


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..inspection.config import QUICK, InspectOptions
    from ..reporting import display_path

    given = {field: (tuple(v) if isinstance(v, list) else v) for field, option in OPTIONS.items()
             if (v := getattr(args, option.removeprefix("--").replace("-", "_"))) is not None}
    given["alpha"] = alpha_options(args, QUICK["alpha"] if args.quick else None)
    if args.lens:
        given["lens"] = True
    try:
        options = InspectOptions(**runtime.with_quick(given, QUICK, args.quick))
    except ValueError as err:
        raise option_error(err, OPTIONS) from None
    for m in options.substeps:
        runtime.check_at_most("--substeps", m, MAX_SUBSTEPS, "each sub-step is a forward pass "
                              "of the model on every window: a bound on time")
    if args.text is not None:
        text = runtime.read_text_file(args.text, "--text")
        source = display_path(args.text)
        runtime.check_text_length(text, args.text, "--text", options.windows * options.window + 1,
                                  f"{options.windows} windows of {options.window} tokens")
    else:
        from ..data import emma_opening

        text = emma_opening()
        source = "svflow_jax/data/emma_opening.txt (Jane Austen, Emma, opening)"
    check_model(args.model)
    out = Path(args.out or runtime.default_out("inspect"))
    args.out_folder = runtime.prepare_out(out, "inspect", overwrite=args.overwrite)
    runtime.fetch_packaged(args.model, parser.prog)
    cache = runtime.setup_jax(args)
    from ..environment import environment
    from ..inspection import study as inspection
    from ..inspection.report import SCHEMA_VERSION, write_inspection

    start = time.perf_counter()
    try:
        loaded = inspection.resolve_model(args.model)
    except (ValueError, RuntimeError) as err:
        raise runtime.UsageError(str(err)) from None
    try:
        inspection.token_windows(loaded.tokenizer, text, options.windows, options.window)
    except ValueError as err:
        raise runtime.UsageError(f"--text {args.text or source}: {err}") from None
    with runtime.progress_bar("svflow inspect", "step", args.no_progress) as (tick, total):
        results = inspection.inspect_model(loaded, text, options, progress=tick, total=total)
    summary = {"schema_version": SCHEMA_VERSION, "model": display_path(args.model),
               "config": {k: (str(v) if not isinstance(v, (int, float, str, bool, type(None)))
                              else v) for k, v in dataclasses.asdict(loaded.config).items()},
               "options": dataclasses.asdict(options),
               "text": {"source": source, "characters": len(text)},
               "compile_cache": cache is not None, "quick": args.quick,
               "results": [r.to_json() for r in results],
               "seconds": time.perf_counter() - start, "environment": environment()}
    write_inspection(out, summary)
    args.out_folder.finish()
    failed = [r.name for r in results if r.passed is False]
    for r in results:
        verdict = {True: "PASS", False: "FAIL", None: "-"}[r.passed]
        print(f"{r.name:<18} {verdict:<5} {r.seconds:6.1f} s")
    print(f"report: {out / 'report.md'}")
    return runtime.EXIT_FAILED if failed else runtime.EXIT_OK
