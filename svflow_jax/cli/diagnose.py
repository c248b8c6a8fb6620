"""``svflow diagnose MODEL``: SVFlow diagnostics of a pretrained model under prefix shuffling
(:mod:`svflow_jax.diagnose`); options are validated (exit code 2) before anything loads."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import runtime
from .common import add_run_options, check_model, option_error, subcommand
from .types import fraction, int_at_least, positive_float, seed

__all__ = ["add_parser", "run", "check_sizes", "MAX_PERMUTATIONS", "MAX_SCALING"]


OPTIONS = ("model", "text", "corpus", "context", "scored", "windows", "levels", "permutations",
           "seed", "bootstrap", "ece_bins", "scaling_factors", "scaling_level", "scaling_windows")


DEFAULT_MODEL = "smollm2-135m-instruct"

#: most permutations per level (``--permutations``): each is a forward pass of the model on
#: every window, a bound on time
MAX_PERMUTATIONS = 1000
#: largest attention-logit factor (``--scaling-factors``)
MAX_SCALING = 100.0
# the size of the default model (SmolLM2-135M) in the estimate of one window's batch: layers x
# heads, and the vocabulary
_LAYER_HEADS, _VOCAB, _MAX_LAYERS = 30 * 9, 49152, 64


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``diagnose`` to ``subparsers`` (of the ``svflow`` parser) and returns it."""
    p = subcommand(
        subparsers, "diagnose",
        help="SVFlow diagnostics of a pretrained model under prefix shuffling",
        description="Per-layer SVFlow metrics (vMF-mixture evidence log p_t, KL(q||p), "
        "KL(q_clean||q_shuffled), attention entropy, concentrations) of a pretrained model on "
        "windows of a text whose first tokens are permuted, against perplexity and calibration "
        "of the scored (last) tokens; Spearman rho with bootstrap intervals, depth "
        "sensitivity, and the attention-logit scaling experiment. Writes config.json, "
        "summary.json, CSVs, PNGs and report.md to --out. Exit code 0 when the run completes "
        "(the verdicts are in the report). Definitions: docs/theory.md, section 19.")
    p.add_argument("model", nargs="?", help="packaged model name (smollm2-135m-instruct, "
                   f"all-minilm-l6-v2) or a checkpoint path (default {DEFAULT_MODEL})")
    p.add_argument("--text", help="one UTF-8 text file: consecutive windows from its start, "
                   "bootstrap over windows (overrides --corpus)")
    p.add_argument("--corpus", choices=("austen", "none"),
                   help="austen (default): Jane Austen's six novels shipped with the package as "
                   "documents, windows/6 passages spread through each, bootstrap over the "
                   "documents; none: the opening of Emma (svflow_jax/data/emma_opening.txt)")
    p.add_argument("--context", type=int_at_least(2), help="tokens per window (default 128)")
    p.add_argument("--scored", type=int_at_least(1),
                   help="scored tokens at the end of each window (default 32)")
    p.add_argument("--windows", type=int_at_least(1),
                   help="number of windows, a multiple of 6 with the corpus (default 36)")
    p.add_argument("--levels", type=fraction, nargs="+", metavar="FRACTION",
                   help="shuffled fractions of the prefix, increasing, including 0 "
                   "(default 0 0.2 0.4 0.6 0.8 1)")
    p.add_argument("--permutations", type=int_at_least(1),
                   help=f"permutations per non-zero level, at most {MAX_PERMUTATIONS} and "
                   "bounded by the machine's memory (default 3)")
    p.add_argument("--seed", type=seed, help="seed, 0 <= seed < 2**32 (default 0)")
    p.add_argument("--bootstrap", type=int_at_least(1),
                   help="bootstrap resamples of the documents, or of the windows of one "
                   "text, bounded by the machine's memory (default 1000)")
    p.add_argument("--ece-bins", type=int_at_least(1), help="equal-mass ECE bins (default 10)")
    p.add_argument("--scaling-factors", type=positive_float, nargs="*", metavar="C",
                   help=f"attention-logit factors, at most {MAX_SCALING:g}; none: skip the "
                   "experiment (default 0.5 0.75 1 1.5 2 3)")
    p.add_argument("--scaling-level", type=fraction,
                   help="shuffle level of the scaling experiment (default 1)")
    p.add_argument("--scaling-windows", type=int_at_least(1),
                   help="windows of the scaling experiment (default: --windows)")
    p.add_argument("--quick", action="store_true",
                   help="a small run for CI (48-token windows, 6 windows, 5 levels, 1 "
                   "permutation, factors 0.5 1 3 on 2 windows); explicit options still win")
    add_run_options(p, "diagnose")
    p.set_defaults(run=run)
    return p


def _config(args: argparse.Namespace):
    from ..diagnose.config import QUICK, StudyConfig
    from . import runtime

    given = {k: getattr(args, k) for k in OPTIONS if getattr(args, k, None) is not None}
    given["model"] = args.model or DEFAULT_MODEL
    for k in ("levels", "scaling_factors"):
        if k in given:
            given[k] = tuple(given[k])
    if given.get("corpus") == "none":
        given["corpus"] = None
    try:
        return StudyConfig(**runtime.with_quick(given, QUICK, args.quick))
    except ValueError as err:
        raise option_error(err, OPTIONS) from None


def check_sizes(config) -> None:
    """Refuses (``UsageError``, exit 2, naming the option) more than :data:`MAX_PERMUTATIONS`
    permutations, attention-logit factors above :data:`MAX_SCALING` and, before anything
    loads, what would not fit in memory
    (:func:`~.runtime.check_memory`): one window's batch (the clean window and every
    permutation of every level run together: float64 attention of every layer and head, and
    the scored tokens' log-probabilities, for a model of the default model's size; a larger
    model needs more), and the bootstrap (every resample's windows, levels and scored tokens of
    every permutation, and every layer's metric)."""
    runtime.check_at_most("--permutations", config.permutations, MAX_PERMUTATIONS,
                          "each is a forward pass of the model on every window: a bound on time")
    for factor in config.scaling_factors:
        runtime.check_at_most("--scaling-factors", factor, MAX_SCALING,
                              "attention logits scaled further overflow float32")
    n, s, K, W = config.context, config.scored, len(config.levels), config.windows
    batch = 1 + (K - 1) * config.permutations
    per_sequence = 8 * (2 * s * _VOCAB + 2 * _LAYER_HEADS * n * n)
    runtime.check_memory(batch * per_sequence,
                         "--permutations" if batch > 16 else "--context",
                         f"one window's batch ({batch} sequences of {n} tokens)")
    resampled = config.bootstrap * W * K * (6 * s * config.permutations + 2 * _MAX_LAYERS)
    runtime.check_memory(8 * resampled, "--bootstrap",
                         f"the bootstrap ({config.bootstrap} resamples of {W} windows)")


def _save_data(path: Path, data) -> None:
    """The raw per-window arrays of the shuffle study (every analysis can be recomputed)."""
    import numpy as np

    from ..atomic import replacing

    arrays = {f"metric_{k}": v for k, v in data.metrics.items()}
    arrays.update({f"per_head_{k}": v for k, v in data.per_head.items()})
    arrays.update({f"control_{k}": v for k, v in data.controls.items()})
    for k in ("nll", "confidence", "correct", "groups"):
        if getattr(data, k) is not None:
            arrays[k] = getattr(data, k)
    with replacing(path) as f:
        np.savez_compressed(f, levels=np.asarray(data.levels), **arrays)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = _config(args)
    check_sizes(config)
    from ..diagnose.config import default_text
    from ..reporting import display_path

    if not config.documents:
        text = Path(config.text) if config.text else default_text()
        content = runtime.read_text_file(text, "--text")  # exists and is UTF-8
        runtime.check_text_length(content, text, "--text", config.windows * (config.context + 1),
                                  f"{config.windows} windows of {config.context} tokens")
    elif config.windows % config.documents:
        raise runtime.UsageError(f"--windows {config.windows} must be a multiple of the "
                                 f"{config.documents} documents of --corpus {config.corpus}")
    check_model(config.model)
    out = Path(args.out or runtime.default_out("diagnose"))
    args.out_folder = runtime.prepare_out(out, "diagnose", overwrite=args.overwrite)
    runtime.fetch_packaged(config.model, parser.prog)
    runtime.setup_jax(cache=False)  # metrics in float64; the model stays float32
    from ..diagnose.output import headline, write_all
    from ..diagnose.study import diagnose

    with runtime.progress_bar("svflow diagnose", "window", args.no_progress) as (tick, total):
        try:
            result = diagnose(config, progress=tick, total=total)
        except ValueError as err:  # e.g. a text too short for the windows asked for
            raise runtime.UsageError(str(err)) from None
    summary = result.summary
    if not config.documents:
        summary["text"]["path"] = ("svflow_jax/data/emma_opening.txt" if not config.text
                                   else display_path(config.text))
    summary["model"]["name"] = display_path(config.model)
    summary["run"] = {"quick": args.quick, "out": display_path(out)}
    write_all(out, summary)
    _save_data(out / "data.npz", result.data)
    args.out_folder.finish()
    print(f"\n{'paper':<58} {'verdict':<15} ours")
    for r in headline(summary):
        print(f"{r['statement'][:58]:<58} {r['verdict']:<15} {r['ours']}")
    print(f"\n{summary['timings']['total_s']:.0f} s; report: {out / 'report.md'}")
    return runtime.EXIT_OK
