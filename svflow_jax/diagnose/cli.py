"""The ``svflow diagnose`` subcommand: :func:`add_diagnose_parser` registers it on the
``svflow`` parser's subparsers; options are validated (exit code 2) before anything loads."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..cli_types import fraction, int_at_least, positive_float

__all__ = ["add_diagnose_parser", "run_diagnose"]


OPTIONS = ("model", "text", "context", "scored", "windows", "levels", "permutations", "seed",
           "bootstrap", "ece_bins", "scaling_factors", "scaling_level", "scaling_windows")


def add_diagnose_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``diagnose`` to ``subparsers`` (of the ``svflow`` parser) and returns it."""
    p = subparsers.add_parser(
        "diagnose", help="SVFlow diagnostics of a pretrained model under prefix shuffling",
        description="Per-layer SVFlow metrics (vMF-mixture evidence log p_t, KL(q||p), "
        "KL(q_clean||q_shuffled), attention entropy, concentrations) of a pretrained model on "
        "windows of a text whose first tokens are permuted, against perplexity and calibration "
        "of the scored (last) tokens; Spearman rho with bootstrap intervals, depth "
        "sensitivity, and the attention-logit scaling experiment. Writes config.json, "
        "summary.json, CSVs, PNGs and report.md to --out. Exit code 0 when the run completes "
        "(the verdicts are in the report), 2 on bad options. Definitions: docs/theory.md, "
        "section 19.")
    p.add_argument("--model", help="packaged model name (smollm2-135m-instruct, "
                   "all-minilm-l6-v2) or a checkpoint path (default smollm2-135m-instruct)")
    p.add_argument("--text", help="UTF-8 text file (default: the opening of Emma, "
                   "svflow_jax/data/emma_opening.txt)")
    p.add_argument("--context", type=int_at_least(2), help="tokens per window (default 128)")
    p.add_argument("--scored", type=int_at_least(1),
                   help="scored tokens at the end of each window (default 32)")
    p.add_argument("--windows", type=int_at_least(1), help="number of windows (default 32)")
    p.add_argument("--levels", type=fraction, nargs="+", metavar="FRACTION",
                   help="shuffled fractions of the prefix, increasing, including 0 "
                   "(default 0 0.2 0.4 0.6 0.8 1)")
    p.add_argument("--permutations", type=int_at_least(1),
                   help="permutations per non-zero level (default 3)")
    p.add_argument("--seed", type=int_at_least(0), help="seed (default 0)")
    p.add_argument("--bootstrap", type=int_at_least(1),
                   help="bootstrap resamples of the windows (default 1000)")
    p.add_argument("--ece-bins", type=int_at_least(1), help="equal-mass ECE bins (default 10)")
    p.add_argument("--scaling-factors", type=positive_float, nargs="*", metavar="C",
                   help="attention-logit factors; none: skip the experiment "
                   "(default 0.5 0.75 1 1.5 2 3)")
    p.add_argument("--scaling-level", type=fraction,
                   help="shuffle level of the scaling experiment (default 1)")
    p.add_argument("--scaling-windows", type=int_at_least(1),
                   help="windows of the scaling experiment (default: --windows)")
    p.add_argument("--quick", action="store_true",
                   help="a small run for CI (48-token windows, 4 windows, 5 levels, 1 "
                   "permutation, factors 0.5 1 3 on 2 windows); explicit options still win")
    p.add_argument("--out", help="output folder (default: results/diagnose-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_diagnose)
    return p


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser):
    from .study import QUICK, StudyConfig

    given = {k: getattr(args, k) for k in OPTIONS if getattr(args, k, None) is not None}
    for k in ("levels", "scaling_factors"):
        if k in given:
            given[k] = tuple(given[k])
    try:
        return StudyConfig(**{**(QUICK if args.quick else {}), **given})
    except ValueError as err:
        parser.error(str(err).replace("_", "-"))


def _save_data(path: Path, data) -> None:
    """The raw per-window arrays of the shuffle study (every analysis can be recomputed)."""
    import numpy as np

    arrays = {f"metric_{k}": v for k, v in data.metrics.items()}
    arrays.update({f"per_head_{k}": v for k, v in data.per_head.items()})
    for k in ("nll", "confidence", "correct"):
        if getattr(data, k) is not None:
            arrays[k] = getattr(data, k)
    np.savez_compressed(path, levels=np.asarray(data.levels), **arrays)


def run_diagnose(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = _config(args, parser)
    from .study import default_text

    text = Path(config.text) if config.text else default_text()
    if not text.is_file():
        parser.error(f"--text: {text}: no such file")
    from .. import packaged

    if config.model not in packaged.MODELS and not Path(config.model).exists():
        parser.error(f"--model: {config.model!r} is neither a packaged model "
                     f"({', '.join(sorted(packaged.MODELS))}) nor a path")
    import jax

    jax.config.update("jax_enable_x64", True)  # metrics in float64; the model stays float32
    from tqdm import tqdm

    from .output import headline, write_all
    from .study import diagnose

    out = Path(args.out or Path("results") / f"diagnose-{time.strftime('%Y%m%d-%H%M%S')}")
    bar = tqdm(desc="svflow diagnose", unit="window", disable=args.no_progress)

    def total(n: int) -> None:
        bar.total = n
        bar.refresh()

    def progress(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update(1)

    try:
        result = diagnose(config, progress=progress, total=total)
    except ValueError as err:  # e.g. a text too short for the windows asked for
        bar.close()
        parser.error(str(err))
    bar.close()
    summary = result.summary
    summary["run"] = {"quick": args.quick, "out": str(out)}
    write_all(out, summary)
    _save_data(out / "data.npz", result.data)
    print(f"\n{'paper':<58} {'verdict':<15} ours")
    for r in headline(summary):
        print(f"{r['statement'][:58]:<58} {r['verdict']:<15} {r['ours']}")
    print(f"\n{summary['timings']['total_s']:.0f} s; report: {out / 'report.md'}")
    return 0
