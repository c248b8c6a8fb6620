"""The ``svflow`` command line (also ``python -m svflow_jax``), one module per subcommand.

* ``verify`` (:mod:`.verify`): the main job. Runs every registered claim
  (:mod:`svflow_jax.claims`): exactness of every Transformer block variant against the flow
  solver it equals, orders of every method of the solver catalogue and of the splittings, drift
  without retraction, Transformer stacks as depth grows; writes ``summary.json``, CSV tables,
  PNG figures and ``report.md`` to ``--out``.
* ``sweep`` (:mod:`.sweep`): a step-size sweep of chosen methods (catalogue names or
  ``package.module:Attr``, the current folder searched first); resumable.
* ``inspect MODEL`` (:mod:`.inspect`): a real checkpoint on real text
  (:mod:`svflow_jax.inspection`).
* ``diagnose MODEL`` (:mod:`.diagnose`): SVFlow diagnostics of a pretrained model under prefix
  shuffling (:mod:`svflow_jax.diagnose`).
* ``train`` (:mod:`.train`): train a method of the catalogue as a layer design.

:mod:`.runtime` sets up what every command needs (x64, the compilation cache, the output
folder, ``--quick`` defaults, size bounds) and maps outcomes to the exit codes: 0 all passed,
1 a claim or check failed, 2 bad input or options, 3 an internal error (traceback in
``error.log`` in ``--out``), 130 interrupted (Ctrl-C: one line, no traceback). Options are
checked before anything is compiled, and before JAX is imported: ``--help``, ``--version``,
``verify --list``, ``train --list-methods`` and every refused option answer in a fraction of a
second (:mod:`.catalog` holds what they need of the claims and the solver catalogue).
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..xla_settings import use_project_flags
from . import diagnose, inspect, runtime, sweep, train, verify
from .common import flow_options

__all__ = ["build_parser", "main", "entry", "flow_options"]

SUBCOMMANDS = (verify, sweep, inspect, diagnose, train)


def build_parser() -> argparse.ArgumentParser:
    """The ``svflow`` parser: one subparser per module of ``SUBCOMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="svflow", epilog=runtime.EPILOG,
        description="Score-based Variational Flow on the sphere: a Transformer is an Euler step.",
    )
    parser.add_argument("--version", action="version", version=f"svflow-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (exit 2 on bad options) and runs the subcommand; returns its exit
    code (:mod:`.runtime`; Ctrl-C: 130 and one line, no traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.argv = argv  # the command as given: the line that says how to resume repeats it
        # svflow_jax.xla_settings: before JAX starts its CPU client; a user's XLA_FLAGS win
        use_project_flags(quick=args.command == "verify" and args.quick)
        sub = parser._subparsers._group_actions[0].choices[args.command]  # pyright: ignore
        return runtime.execute(args.run, args, sub)
    except KeyboardInterrupt:
        print("svflow: interrupted", file=sys.stderr, flush=True)
        return runtime.EXIT_INTERRUPTED


def entry() -> None:
    """The ``svflow`` console script and ``python -m svflow_jax``: :func:`main`, whose exit code
    ends the process. After Ctrl-C the process ends at once (``os._exit``, output flushed,
    the output folder's lock already released): the interpreter's shutdown would wait for
    threads still compiling or measuring (``verify --jobs``), and an interrupt that landed inside
    a JAX compilation can leave state that crashes the shutdown."""
    code = main()
    if code == runtime.EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
