"""Options shared by the ``svflow`` subcommands: the random-flow options of ``verify`` and
``sweep`` (:func:`add_flow_options`, :func:`flow_options`) and the run options of every
command (:func:`add_run_options`: ``--out``, ``--overwrite``, ``--no-progress``, the
compilation cache)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping

from .runtime import EPILOG, UsageError, with_quick
from .types import positive_float, positive_int, seed

__all__ = ["add_flow_options", "add_run_options", "check_model", "flow_options", "option_error",
           "resolve_methods", "subcommand", "EPILOG"]


def subcommand(subparsers, name: str, **kwargs) -> argparse.ArgumentParser:
    """A subparser whose ``--help`` ends with the exit codes."""
    return subparsers.add_parser(name, epilog=EPILOG, **kwargs)


def add_run_options(p: argparse.ArgumentParser, command: str, *, cache: bool = True) -> None:
    """``--out``, ``--overwrite``, ``--no-progress`` and (``cache``) the compilation cache."""
    p.add_argument("--out", help=f"output folder (default: results/{command}-<time>)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an --out folder that holds other files: they are kept and "
                   "the outputs are written beside them (refused when an output would replace "
                   "one of them); a folder holding a model or another command's run is "
                   "refused even so. A folder of an earlier run of the same command needs no "
                   "--overwrite: its own outputs are replaced")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    if cache:
        p.add_argument("--no-compile-cache", action="store_true",
                       help="do not use JAX's persistent compilation cache")
        p.add_argument("--cache-dir", help="compilation cache folder (default: "
                       "$SVFLOW_CACHE_DIR, else ~/.cache/svflow-jax/xla), trimmed to 2 GiB "
                       "when opened, the programs used longest ago first")


def option_error(err: ValueError, options: Iterable[str] | Mapping[str, str]) -> UsageError:
    """The ``UsageError`` of an options object's ``ValueError``: when the message starts with
    one of ``options`` (the object's field names; a mapping gives the option of each), that
    field is written as its option (``num_sizes`` as ``--num-sizes``). Nothing else of the
    message changes: the values a user gave appear as given."""
    names = (dict(options) if isinstance(options, Mapping)
             else {field: "--" + field.replace("_", "-") for field in options})
    message = str(err)
    head = message.split(" ", 1)[0].rstrip(":")
    if head in names:
        message = names[head] + message[len(head):]
    return UsageError(message)


def resolve_methods(names: Iterable[str], option: str) -> list:
    """The :class:`~svflow_jax.solvers.catalogue.Method` of each name: a name of the solver
    catalogue or ``package.module:Attr`` (a user's module, the current folder searched first;
    :func:`svflow_jax.solvers.catalogue.get`). ``UsageError`` naming ``option`` otherwise:
    a name that is neither is refused before JAX is imported (:mod:`.catalog`)."""
    from .catalog import check_methods

    names = list(names)
    check_methods(names, option)
    from ..solvers import catalogue

    try:
        return [catalogue.get(name) for name in names]
    except ValueError as err:
        raise UsageError(f"{option}: {err}") from None


def check_model(model: str) -> None:
    """Refuses (``UsageError``) a MODEL that is neither a packaged model's name nor an existing
    file or folder (:func:`svflow_jax.checkpoints.resolve`, nothing fetched yet)."""
    from ..checkpoints.paths import CheckpointError, resolve

    try:
        resolve(model, fetch=False)
    except CheckpointError as err:
        raise UsageError(f"MODEL {err}") from None


def add_flow_options(p: argparse.ArgumentParser) -> None:
    """The random smooth SVFlow of ``verify`` and ``sweep``."""
    p.add_argument("--seed", type=seed, help="random seed, 0 <= seed < 2**32 (default 0)")
    p.add_argument("--dtype", choices=("float64", "float32"),
                   help="floating-point type of states and parameters (default float64)")
    p.add_argument("--tokens", type=positive_int, help="number of tokens n (default 8)")
    p.add_argument("--dim", type=positive_int,
                   help="dimension d of R^d, a multiple of 4, bounded by the machine's memory "
                   "(default 16)")
    p.add_argument("--t1", type=positive_float,
                   help=f"final time T; T x strength at most {MAX_FLOW:g} (default 1)")
    p.add_argument("--strength", type=positive_float,
                   help=f"scale of the random weights: the speed of the flow, at most "
                   f"{MAX_FLOW:g} (default 1)")
    p.add_argument("--repeats", type=positive_int,
                   help="timed repetitions per solve; the median is reported (default 3)")
    p.add_argument("--num-sizes", type=positive_int,
                   help="step sizes per solver sweep, >= 3 (default: per solver)")


FLOW_OPTIONS = ("seed", "dtype", "tokens", "dim", "layers", "t1", "strength", "repeats",
                "step_scale", "num_sizes")


def flow_options(args: argparse.Namespace, quick: bool = False):
    """The validated :class:`~svflow_jax.claims.Options`: explicit options win, ``--quick``
    fills in its small defaults, the rest are the library defaults; then the size bounds
    (``check_sizes``). ``UsageError`` naming the option. Imports no JAX."""
    from ..claims.core import QUICK, Options

    given = {k: getattr(args, k) for k in FLOW_OPTIONS if getattr(args, k, None) is not None}
    try:
        options = Options(**with_quick(given, QUICK, quick))
    except ValueError as err:
        raise option_error(err, FLOW_OPTIONS) from None
    check_sizes(options)
    return options


# Bounds of the random flow (documented in the options' help): attention holds n x n scores per
# head and layer, every solve holds a few states of n x d, and every layer 8 d x d weights.
MAX_REPEATS = 1000
#: deepest Transformer of the exactness claims (``--layers``): a bound on compile and run time
MAX_LAYERS = 4096
#: fastest flow, ``--strength`` and ``--t1 x --strength`` (the distance the tokens travel, in
#: units of the default flow's): the float64 reference solve of a faster one stops at its step
#: limit (``--strength 100`` does; 30 finishes)
MAX_FLOW = 30.0


def check_sizes(options) -> None:
    """Refuses (``UsageError``, exit 2) sizes that cannot run: more memory than the machine can
    give (``--tokens``, ``--dim``, ``--layers``: :func:`~.runtime.check_memory`), more than
    :data:`MAX_LAYERS` layers, a single token, a width the claims' Transformers cannot split
    into two heads of even width (``--dim`` not a multiple of 4), and more than
    :data:`~.runtime.MAX_STEPS` steps per solve, :data:`MAX_REPEATS` timed repetitions or a
    flow faster than :data:`MAX_FLOW`."""
    from .runtime import MAX_STEPS, check_at_most, check_memory

    n, d = options.tokens, options.dim
    if n < 2:
        raise UsageError(f"--tokens {n}: at least 2 (with one token attention is the identity "
                         "and the pre-norm and order claims measure nothing)")
    if d % 4:
        raise UsageError(f"--dim {d}: must be a multiple of 4 (the Transformers of the claims "
                         "have 2 heads of width d / 2, even for rotary embeddings)")
    # float64: n x n attention scores of the 2 heads, a few copies (logits, softmax, its
    # derivative, stages under vmap), and a few dozen n x d states (stages, references)
    per_solve = 8 * (8 * n * n + 64 * n * d)
    check_memory(per_solve, "--tokens" if n >= d else "--dim",
                 f"a flow of {n} tokens in d = {d}")
    check_at_most("--layers", options.layers, MAX_LAYERS, "a bound on compile and run time")
    # float64 weights: attention (4 d x d) and FFN (2 d x 2d) per layer, for the exactness
    # Transformers, the deepest stack and the anchors, each drawn, copied to the device and
    # mapped to the flow's parameters (3 copies)
    layers = options.layers + max(options.depths) + 4
    check_memory(8 * 8 * d * d * layers * 3,
                 "--layers" if options.layers > max(options.depths) else "--dim",
                 f"the weights of {layers} layers in d = {d}")
    for option, value in (("--strength", options.strength),
                          ("--t1 x --strength", options.t1 * options.strength)):
        if value > MAX_FLOW:
            raise UsageError(f"{option} {value:g}: at most {MAX_FLOW:g} (the float64 reference "
                             "solve of a faster flow does not finish within its step limit)")
    if options.repeats > MAX_REPEATS:
        raise UsageError(f"--repeats {options.repeats}: at most {MAX_REPEATS}")
    if options.num_sizes is not None and options.num_sizes > 1000:
        raise UsageError(f"--num-sizes {options.num_sizes}: at most 1000")
    from .catalog import largest_sweep

    largest = largest_sweep() * options.step_scale
    if largest > MAX_STEPS:
        raise UsageError(f"--step-scale {options.step_scale:g}: sweeps would take up to "
                         f"{largest:.3g} steps per solve, more than {MAX_STEPS}")
