#!/usr/bin/env python3
"""Mutation testing of the code that turns numbers into verdicts. Run by hand, not by CI.

A *mutant* is the source with one small plausible bug: a comparison operator changed (``<`` ->
``<=``, ``<`` -> ``>=``, ``is`` -> ``is not``, ...), a number changed (x10, /10, +1 and -1 for
integers, 0.95 -> 0.9), ``and`` <-> ``or``, a ``not`` or a unary minus dropped, ``min`` <->
``max``, ``argmin`` <-> ``argmax``, ``all`` <-> ``any``. Mutants are made only inside the
functions and module-level assignments listed in :data:`TARGETS` (the pass rules, tolerances,
p-value formulas, interval levels and "best" selections), never in f-strings (messages). Each
sampled mutant is written over its module in place (the original bytes are always written back:
on success, on a failure, on Ctrl-C, on SIGTERM), its module's mapped tests (:data:`TESTS`) run
with ``pytest -x -q -n 0`` under a timeout, and the mutant is ``killed`` when they fail,
``survived`` when they pass, ``timeout`` when they run out of time (counted as not killed).

    python .ci/mutants.py --list                  # every mutant, nothing run
    python .ci/mutants.py --sample 60 --seed 0    # run 60 sampled mutants
    python .ci/mutants.py --modules claims/measure.py --ids 12 40

Writes a TSV (``--tsv``, default ``.ci/artifacts/mutants.tsv``) with one row per mutant and
prints a summary line. Before the mutants, the mapped tests run once on the unmutated code
(``--no-baseline`` skips it): a failing baseline would make every mutant look killed.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent

# module -> the functions (qualified names: "Class.method") and module-level assignments
# (constant names) that decide a verdict; "name[a,b]": only the statements of the function that
# use the variables (or dictionary keys) a or b (a claim's verdict, not the setup of its
# measurement: its seeds, sizes and configurations)
TARGETS: dict[str, list[str]] = {
    "svflow_jax/claims/core.py": ["_positive_int", "_positive_float", "Options.__post_init__"],
    "svflow_jax/claims/measure.py": [
        "EXACT_FLOAT64", "C_FLOAT32", "ORDER_TOLERANCE", "HIGH_ORDER_EXCESS", "FIT_FLOOR",
        "FIT_FLOOR_FLOAT32", "FIT_CEILING", "MIN_STEPS_IN_FIT", "UNIT_ROUNDOFF",
        "matmul_unit_roundoff", "_float32_epsilon", "exactness_tolerance", "fit_floor",
        "_succeeded", "fit_window", "order_passes"],
    "svflow_jax/claims/exactness.py": [
        "_exactness[tolerance,passed,factor]", "_gaps[per_layer]",
        "plain_solve[diff,tolerance,passed]", "float32_bound[eps,layers,ratio,passed,visible]",
        "round_trip[a,b,bad,failures,_RESCALED]", "ellipsoid[tolerance,passed]"],
    "svflow_jax/claims/orders.py": [
        "sweep_counts", "_order_verdict", "solver_sweep[fit,resolved,passed,tolerance]",
        "_splitting[fit,passed,expected]", "aligned_rk4[fit,naive_fit,passed]",
        "drift[tolerance,on_sphere,off,passed]"],
    "svflow_jax/claims/stacks.py": [
        "_order", "one_step_gap[fit,passed,visible]", "postnorm_stack[fit,passed]",
        "prenorm_coupled[fit,passed]", "prenorm_not_sphere[finest,spread,passed]",
        "prenorm_projected[fit,passed]", "gain_departure[used,fit,passed]"],
    "svflow_jax/claims/run.py": ["summary[passed]"],
    "svflow_jax/objective/terms.py": ["usage_stats"],
    "svflow_jax/objective/mechanism.py": ["cosine"],
    "experiments/objective_moe.py": [
        "ALPHA", "MARGIN", "ATTENTION_FLOOR", "decision", "decide", "_verdict", "verdicts"],
    "svflow_jax/reporting.py": ["verdict"],
    "svflow_jax/training/compare.py": ["interval", "equal_compute_steps", "ORDER_BAND",
                                       "order_regime"],
    "svflow_jax/diagnose/stats.py": [
        "percentile_interval", "bonferroni_resamples", "_check_test", "one_sided_p",
        "spearman_permutation_p", "spearman_exact_p", "smallest_p",
        "level_controlled_spearman[joint,null_s,null_p,null_c,controlled_p]"],
    "svflow_jax/diagnose/output.py": [
        "_tested", "_controlled", "_verdict", "former_verdict", "tracks_perplexity",
        "headline[lo,ok,growth,oc_up,top,m,controls]"],
    "svflow_jax/diagnose/study.py": [
        "population_verdict", "_design[bound,document_claims_possible]",
        "across_models[bound,resamples]", "_thirds"],
    "svflow_jax/inspection/alpha_sweep.py": [
        "LEVEL", "window_interval", "_loss_row", "_top", "sweep_figures"],
    "experiments/power.py": ["holm"],
}

# module -> the fast tests (files or node ids) that must fail on its mutants
_BOUNDARIES = "tests/test_verdict_boundaries.py"
_CLAIMS_FAST = [
    _BOUNDARIES,
    "tests/test_claims.py::test_options_are_validated",
    "tests/test_claims.py::test_step_counts_are_distinct_and_geometric",
    "tests/test_claims.py::test_high_orders_pass_in_a_band_not_at_any_higher_order",
    "tests/test_claims.py::test_fit_window_keeps_only_the_asymptotic_points",
    "tests/test_claims.py::test_matmul_unit_roundoff_rule",
]
_DIAGNOSE = "tests/test_diagnostics.py::test_"
_DIAGNOSE_FAST = [_DIAGNOSE + name for name in (
    "spearman_and_ranks_match_scipy_with_ties", "bootstrap_is_deterministic_by_seed",
    "cluster_bootstrap_draws_whole_documents",
    "across_models_verdicts_null_monotone_and_wrong_sign",
    "across_models_null_is_rarely_reproduced",
    "permutation_p_of_spearman_matches_scipy_exact_test",
    "level_controlled_statistics_match_scipy",
    "level_controlled_p_values_are_calibrated_under_the_null",
    "a_metric_of_the_level_alone_is_not_reproduced",
    "design_null_is_calibrated_under_window_effects_and_the_former_is_not",
    "document_null_is_calibrated_under_document_effects",
    "controlled_rho_is_calibrated_when_the_control_explains_both",
    "design_permutations_move_windows_and_whole_documents",
    "level_controlled_p_values_by_brute_force",
    "one_sided_p_counts_ties_the_observed_draw_and_the_direction",
    "exact_spearman_p_over_six_units", "percentile_interval_level_and_resamples_for_bonferroni",
    "bonferroni_interval_covers_at_its_level", "pass_rule_at_the_bonferroni_bound",
    "pass_rule_needs_the_expected_sign", "verdict_names_and_the_former_rule",
    "population_verdict_at_its_boundaries", "metric_records_fix_the_comparisons",
    "controls_decide_what_a_metric_adds",
    "across_models_bonferroni_interval_level_and_resamples",
    "permutation_tests_take_three_units_and_the_exact_one_at_most_eight",
    "one_sided_p_counts_a_tie_to_1e_12_and_no_further",
    "bonferroni_resamples_rounds_up_beyond_1e_9_and_checks_its_arguments",
    "percentile_interval_default_level_and_no_finite_sample",
    "documents_allow_a_claim_only_when_their_smallest_p_is_below_the_bound",
    "depth_uses_thirds_of_the_layers_at_least_one",
    "headline_depth_and_scaling_verdicts_at_their_boundaries",
    "the_headline_bonferroni_m_counts_the_svflow_metrics_only",
    "across_models_with_one_tested_metric_is_not_corrected")]
_ALPHA = "tests/test_alpha_sweep.py::test_"
_ALPHA_FAST = [_ALPHA + name for name in (
    "sweep_figures_read_the_argmin_and_the_rankings",
    "window_interval_is_the_two_sided_t_interval_at_95_percent",
    "a_loss_row_pairs_the_windows", "sweep_figures_at_their_boundaries", "profiles")]
TESTS: dict[str, list[str]] = {
    "svflow_jax/claims/core.py": _CLAIMS_FAST,
    "svflow_jax/claims/measure.py": _CLAIMS_FAST,
    "svflow_jax/claims/exactness.py": _CLAIMS_FAST,
    "svflow_jax/claims/orders.py": _CLAIMS_FAST,
    "svflow_jax/claims/stacks.py": _CLAIMS_FAST,
    "svflow_jax/claims/run.py": _CLAIMS_FAST,
    "svflow_jax/objective/terms.py": [_BOUNDARIES],
    "svflow_jax/objective/mechanism.py": [_BOUNDARIES],
    "experiments/objective_moe.py": ["tests/test_objective_verdicts.py"],
    "svflow_jax/reporting.py": [_BOUNDARIES],
    "svflow_jax/training/compare.py": [_BOUNDARIES, "tests/test_fitting.py",
                                       "tests/test_convergence.py"],
    "svflow_jax/diagnose/stats.py": _DIAGNOSE_FAST,
    "svflow_jax/diagnose/output.py": _DIAGNOSE_FAST,
    "svflow_jax/diagnose/study.py": _DIAGNOSE_FAST,
    "svflow_jax/inspection/alpha_sweep.py": _ALPHA_FAST,
    "experiments/power.py": ["tests/test_power.py::test_holm_on_both_sides_of_its_thresholds"],
}

_COMPARE = {ast.Lt: (ast.LtE, ast.GtE), ast.LtE: (ast.Lt, ast.Gt), ast.Gt: (ast.GtE, ast.LtE),
            ast.GtE: (ast.Gt, ast.Lt), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,),
            ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,)}
_SYMBOL = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==",
           ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not"}
_SWAPS = {"min": "max", "max": "min", "argmin": "argmax", "argmax": "argmin",
          "nanmin": "nanmax", "nanmax": "nanmin", "amin": "amax", "amax": "amin",
          "all": "any", "any": "all"}


class Mutant(NamedTuple):
    """One mutant: ``source`` is the whole mutated module."""

    module: str  # path relative to the root
    target: str  # the function or assignment it lies in
    line: int
    kind: str  # compare | number | boolean | not | sign | swap
    description: str
    source: bytes


def _numbers(value: int | float) -> list[int | float]:
    if isinstance(value, int):
        out: list[int | float] = [value + 1, value - 1, value * 10]
    else:
        out = [value * 10, value / 10]
        if value == 0.95:
            out.append(0.9)
    return [v for v in dict.fromkeys(out) if v != value]


def _replacements(node: ast.AST) -> Iterator[tuple[str, str, ast.AST | str]]:
    """``(kind, description, replacement)`` for each mutation of ``node``: a node (written
    with ``ast.unparse``) or a literal text."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new in _COMPARE.get(type(op), ()):
                ops = list(node.ops)
                ops[i] = new()
                yield ("compare", f"{_SYMBOL[type(op)]} -> {_SYMBOL[new]}",
                       ast.Compare(node.left, ops, node.comparators))
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        for v in _numbers(node.value):
            yield "number", f"{node.value!r} -> {v!r}", repr(v)
    elif isinstance(node, ast.BoolOp):
        new = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        names = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        yield "boolean", f"{names[0]} -> {names[1]}", ast.BoolOp(new, node.values)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
        kind = "sign" if isinstance(node.op, ast.USub) else "not"
        yield kind, f"{'-' if kind == 'sign' else 'not '}x -> x", node.operand
    elif isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in _SWAPS:
            yield "swap", f"{func.id} -> {_SWAPS[func.id]}", _SWAPS[func.id]
        elif isinstance(func, ast.Attribute) and func.attr in _SWAPS:
            yield ("swap", f".{func.attr} -> .{_SWAPS[func.attr]}",
                   ast.Attribute(func.value, _SWAPS[func.attr], ast.Load()))


def _spans(node: ast.AST) -> ast.AST:
    """The node whose source span a mutation of ``node`` replaces (a call's function)."""
    return node.func if isinstance(node, ast.Call) else node


def _parse_target(spec: str) -> tuple[str, set[str] | None]:
    """``"name"`` -> ``("name", None)``; ``"name[a,b]"`` -> ``("name", {"a", "b"})``."""
    if spec.endswith("]"):
        name, _, rest = spec[:-1].partition("[")
        return name, {n.strip() for n in rest.split(",")}
    return spec, None


_COMPOUND = (ast.If, ast.While, ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Try,
             ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _headers(stmt: ast.stmt) -> list[ast.AST]:
    """The expressions a statement owns: all of a simple statement; a compound one's header
    (an ``if``'s test, a ``for``'s target and iterable), not its body."""
    if isinstance(stmt, (ast.If, ast.While)):
        return [stmt.test]
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        return [stmt.target, stmt.iter]
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return list(stmt.items)
    if isinstance(stmt, _COMPOUND):
        return []
    return [stmt]


def _mentions(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names
               or isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names
               for n in ast.walk(node))


def _regions(function: ast.AST, names: set[str] | None) -> list[ast.AST]:
    """The parts of ``function`` to mutate: all of it, or with ``names`` the statements (their
    own expressions: a compound statement's header) that use one of ``names`` (a variable, or a
    string such as a dictionary key)."""
    if names is None:
        return [function]
    return [h for stmt in ast.walk(function) if isinstance(stmt, ast.stmt) and stmt is not function
            for h in _headers(stmt) if _mentions(h, names)]


def _targets_in(tree: ast.Module, specs: Sequence[str]) -> Iterator[tuple[str, list[ast.AST]]]:
    """``(name, regions)`` of every listed function (``name`` or ``name[var,...]``: only the
    statements using those variables) and module-level assignment (its value)."""
    wanted = dict(_parse_target(s) for s in specs)
    found = set()

    def visit(body, prefix: str):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + node.name
                if name in wanted and not isinstance(node, ast.ClassDef):
                    found.add(name)
                    yield name, _regions(node, wanted[name])
                else:
                    yield from visit(node.body, name + ".")
            elif not prefix and isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and t.id in wanted and node.value is not None:
                        found.add(t.id)
                        yield t.id, [node.value]

    yield from visit(tree.body, "")
    missing = set(wanted) - found
    if missing:
        raise ValueError(f"not found: {sorted(missing)}")


def _offsets(source: bytes) -> list[int]:
    """Byte offset of the start of every line (1-based lines: index ``lineno - 1``)."""
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def mutants(path: Path, names: Sequence[str], module: str | None = None) -> list[Mutant]:
    """Every mutant of the listed functions and assignments of the module at ``path``, in
    source order; a mutant whose module parses to the original tree is dropped (equivalent
    by construction), as is a second one with the same source."""
    source = path.read_bytes()
    tree = ast.parse(source)
    original = ast.dump(tree)
    starts = _offsets(source)
    out, seen = [], set()
    for name, regions in _targets_in(tree, names):
        nodes = [n for region in regions for n in ast.walk(region)]
        fstrings = {id(n) for j in nodes if isinstance(j, ast.JoinedStr) for n in ast.walk(j)}
        for node in nodes:
            if id(node) in fstrings:
                continue
            for kind, description, replacement in _replacements(node):
                span = _spans(node)
                text = (replacement if isinstance(replacement, str)
                        else ast.unparse(replacement))
                if not isinstance(replacement, str) and not isinstance(
                        replacement, (ast.Name, ast.Attribute, ast.Constant)):
                    text = f"({text})"
                lineno, col = span.lineno, span.col_offset  # type: ignore[attr-defined]
                end_lineno, end_col = span.end_lineno, span.end_col_offset  # type: ignore[attr-defined]
                assert end_lineno is not None and end_col is not None
                a, b = starts[lineno - 1] + col, starts[end_lineno - 1] + end_col
                new = source[:a] + text.encode() + source[b:]
                try:
                    if ast.dump(ast.parse(new)) == original:
                        continue
                except SyntaxError:
                    continue
                if new in seen:
                    continue
                seen.add(new)
                out.append(Mutant(module or str(path), name, lineno, kind, description, new))
    return sorted(out, key=lambda m: (m.line, m.kind, m.description))


def all_mutants(modules: Sequence[str] | None = None, root: Path = ROOT) -> list[Mutant]:
    chosen = _choose(modules)
    return [m for module in chosen for m in mutants(root / module, TARGETS[module], module)]


def _choose(modules: Sequence[str] | None) -> list[str]:
    if not modules:
        return list(TARGETS)
    chosen = []
    for wanted in modules:
        hits = [m for m in TARGETS if m == wanted or m.endswith("/" + wanted.lstrip("/"))]
        if not hits:
            raise SystemExit(f"no target module matches {wanted!r}; modules: {list(TARGETS)}")
        chosen += [h for h in hits if h not in chosen]
    return chosen


# ------------------------------------------------------------------------------------- running

class _Interrupted(BaseException):
    pass


def _raise_interrupted(signum, frame):
    raise _Interrupted(f"signal {signum}")


@contextlib.contextmanager
def patched(path: Path, source: bytes) -> Iterator[None]:
    """``path`` holds ``source`` inside the block; its original bytes are written back on the
    way out, whatever ends the block (an exception, Ctrl-C, SIGTERM or SIGHUP), and its cached
    bytecode is removed both times (a ``.pyc`` written in the same second as the source could be
    taken for the mutated module's)."""
    original = path.read_bytes()
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        _drop_bytecode(path)
        path.write_bytes(source)
        yield
    finally:
        path.write_bytes(original)
        _drop_bytecode(path)
        for s, handler in old.items():
            signal.signal(s, handler)


def _drop_bytecode(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(importlib.util.cache_from_source(str(path)))


def run_tests(command: Sequence[str], timeout: float, cwd: Path = ROOT) -> tuple[str, float]:
    """``(status, seconds)`` of one test command: ``survived`` (exit 0), ``killed`` (any other
    exit: tests failed, or could not be collected: a node id not found because its module no
    longer imports exits 4), ``timeout``. The baseline run (:func:`main`) makes sure the command
    itself is right."""
    env = _environment(cwd)
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return "timeout", time.perf_counter() - start
    except BaseException:
        _kill(proc)
        raise
    seconds = time.perf_counter() - start
    return ("survived" if code == 0 else "killed"), seconds


def _environment(root: Path) -> dict[str, str]:
    """The tests' environment: ``root`` first on ``PYTHONPATH`` (an editable install of
    another checkout must not be what the tests import), no bytecode written."""
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=path)


def imported_from(root: Path = ROOT) -> Path:
    """Where the tests' interpreter imports ``svflow_jax`` from, in the tests' environment."""
    out = subprocess.run([sys.executable, "-c", "import svflow_jax; print(svflow_jax.__file__)"],
                         cwd=root, env=_environment(root), capture_output=True, text=True,
                         check=True)
    return Path(out.stdout.strip()).resolve()


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the tests and their children
    proc.wait()


def pytest_command(tests: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
            *tests]


def _tsv_row(*cells) -> str:
    return "\t".join(str(c).replace("\t", " ") for c in cells) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--sample", type=int, help="run this many mutants, drawn with --seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modules", nargs="+", help="target modules (a path or its tail)")
    p.add_argument("--ids", nargs="+", type=int, help="run these mutants (numbers of --list)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    p.add_argument("--tsv", type=Path, default=ROOT / ".ci" / "artifacts" / "mutants.tsv")
    p.add_argument("--no-baseline", action="store_true",
                   help="do not run the tests on the unmutated code first")
    args = p.parse_args(argv)

    every = all_mutants(args.modules)
    numbered = list(enumerate(every))
    if args.list:
        for i, m in numbered:
            print(f"{i}\t{m.module}:{m.line}\t{m.target}\t{m.kind}\t{m.description}")
        print(f"{len(every)} mutants")
        return 0
    if args.ids:
        chosen = [numbered[i] for i in args.ids]
    elif args.sample:
        chosen = sorted(random.Random(args.seed).sample(numbered, min(args.sample, len(every))),
                        key=lambda im: im[0])
    else:
        chosen = numbered

    package = imported_from()
    if not package.is_relative_to(ROOT):
        print(f"the tests would import svflow_jax from {package}, not from {ROOT}: no mutant "
              "run", file=sys.stderr)
        return 2
    if not args.no_baseline:
        for module in dict.fromkeys(m.module for _, m in chosen):
            status, seconds = run_tests(pytest_command(TESTS[module]), args.timeout)
            print(f"baseline {module}: {status} ({seconds:.0f} s)", flush=True)
            if status != "survived":
                print("the tests fail on the unmutated code: no mutant run", file=sys.stderr)
                return 2

    args.tsv.parent.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    with args.tsv.open("w") as out:
        out.write(_tsv_row("id", "module", "line", "target", "kind", "mutation", "status",
                           "seconds"))
        for i, m in chosen:
            with patched(ROOT / m.module, m.source):
                status, seconds = run_tests(pytest_command(TESTS[m.module]), args.timeout)
            counts[status] = counts.get(status, 0) + 1
            out.write(_tsv_row(i, m.module, m.line, m.target, m.kind, m.description, status,
                               f"{seconds:.1f}"))
            out.flush()
            print(f"{i:4d} {status:8s} {seconds:5.0f} s  {m.module}:{m.line} {m.target}: "
                  f"{m.description}", flush=True)
    run = sum(counts.values())
    rate = counts.get("killed", 0) / run if run else float("nan")
    print(f"mutants: {run} run (seed {args.seed}, of {len(every)}): "
          f"{counts.get('killed', 0)} killed, {counts.get('survived', 0)} survived, "
          f"{counts.get('timeout', 0)} timeout; kill rate {rate:.1%}; {args.tsv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
