"""The first seconds of an ``svflow`` command: ``--help``, ``--version``, ``verify --list``,
``train --list-methods`` and refused options answer before JAX is imported, in well under
2 seconds (importing JAX takes 2 to 20); the tables they answer from
(:mod:`svflow_jax.cli.catalog`) equal the registries; the line said before the first
compilation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from scripts_for_tests import ROOT

from svflow_jax import method_table
from svflow_jax.cli import catalog, runtime

# Each in a fresh interpreter: the import of the command line, the command, and which of the
# heavy packages it loaded. Exit codes: 0 (answered), 2 (refused).
_PROBE = """
import json, sys, time
start = time.perf_counter()
import svflow_jax.cli as cli
try:
    code = cli.main(json.loads(sys.argv[1]))
except SystemExit as exit_:
    code = exit_.code
seconds = time.perf_counter() - start
heavy = sorted(m for m in ("jax", "jaxlib", "flax", "diffrax", "optax", "orbax",
                           "svflow_jax.claims.exactness", "svflow_jax.solvers.catalogue")
               if m in sys.modules)
print(json.dumps({"code": code, "seconds": seconds, "heavy": heavy}), file=sys.stderr)
"""

FAST = [
    (["--version"], 0),
    (["verify", "--help"], 0),
    (["verify", "--list"], 0),
    (["train", "--list-methods"], 0),
    (["verify", "--dim", "6"], 2),
    (["train", "--d-model", "100000000"], 2),
    (["sweep", "--methods", "nope"], 2),
    (["verify", "--only", "nope"], 2),
    (["train", "--method", "geodesic-euler"], 2),
    (["sweep", "--steps", "16", "8"], 2),
    (["diagnose", "--permutations", "100000"], 2),
    (["inspect", "smollm2-135m-instruct", "--windows", "0"], 2),
    (["inspect", "smollm2-135m-instruct", "--methods", "nope"], 2),
    (["inspect", "smollm2-135m-instruct", "--alpha-methods", "nope"], 2),
    (["inspect", "smollm2-135m-instruct", "--substeps", "1"], 2),
    (["inspect", "smollm2-135m-instruct", "--substeps", "2048"], 2),
    (["inspect", "/nonexistent"], 2),
    (["diagnose", "/nonexistent"], 2),
    (["train", "--update", "ngpt", "--norm", "pre"], 2),
    (["train", "--update", "ngpt"], 2),
    (["train", "--extra-depths", "8"], 2),
    (["train", "--random-depths", "2", "8", "--weights", "per_layer"], 2),
    (["train", "--weights", "linear", "--extra-depths", "8", "--random-depths", "2"], 2),
    (["train", "--method", "geodesic-euler", "--norm", "pre"], 2),
    (["train", "--embed-norm", "--norm", "post"], 2),
]


@pytest.mark.parametrize(("argv", "code"), FAST, ids=[" ".join(a) for a, _ in FAST])
def test_listings_help_and_refusals_answer_before_jax_is_imported(argv, code, tmp_path):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=120)
    wall = time.perf_counter() - start
    probe = json.loads(proc.stderr.strip().splitlines()[-1])
    assert probe["code"] == code, proc.stderr
    assert probe["heavy"] == [], probe
    assert "Traceback" not in proc.stderr
    # the command itself (import of the command line included); the interpreter's own start
    # comes on top (wall)
    assert probe["seconds"] < 2, (argv, probe["seconds"], wall)
    assert not list(tmp_path.iterdir())  # nothing written
    print(f"{' '.join(argv)}: {probe['seconds']:.2f} s in the command, {wall:.2f} s wall")


def test_the_tables_are_the_registries():
    """Regenerate with ``python -m svflow_jax.cli.catalog`` when a claim or method changes."""
    from svflow_jax import claims
    from svflow_jax.solvers import catalogue

    assert catalog.CLAIMS == tuple((c.name, c.statement) for c in claims.select())
    assert method_table.METHODS == tuple(map(method_table.row, catalogue.methods()))
    assert catalog.generated() in open(catalog.__file__).read()
    assert catalog.generated_methods() in open(method_table.__file__).read()


def test_the_early_refusals_say_what_the_registries_say():
    from svflow_jax import claims
    from svflow_jax.solvers import catalogue

    with pytest.raises(ValueError) as late:
        catalogue.get("nope")
    with pytest.raises(runtime.UsageError) as early:
        catalog.check_methods(["euler", "my_module:Attr", "nope"], "--methods")
    assert str(early.value) == f"--methods: {late.value}"
    with pytest.raises(ValueError) as late:
        claims.select(["nope", "order/"])
    with pytest.raises(runtime.UsageError) as early:
        catalog.check_claim_prefixes(["nope", "order/"])
    assert str(early.value) == str(late.value)
    with pytest.raises(ValueError) as late:
        catalogue.get("geodesic-euler").solver_for("pre")
    assert method_table.has_prenorm_form("geodesic-euler") is False
    assert method_table.has_prenorm_form("euler") is True
    assert method_table.has_prenorm_form("x") is None
    from svflow_jax.cli import build_parser
    from svflow_jax.cli.train import _check_planned

    args = build_parser().parse_args(["train", "--method", "geodesic-euler", "--norm", "pre"])
    with pytest.raises(runtime.UsageError) as early:
        _check_planned(args)
    assert str(early.value) == str(late.value)
    assert catalog.largest_sweep() == max(m.step_range[1] for m in catalogue.methods())


def test_the_line_before_the_first_compilation(tmp_path, capsys):
    """Cold: how many programs and where they will be kept; warm: the cache and what it holds;
    none: said so. One line on stderr."""
    cache = tmp_path / "cache"
    runtime.announce_compiling("svflow verify", 58, str(cache))
    assert capsys.readouterr().err == (
        f"svflow verify: compiling about 58 programs (cached for next time in {cache})\n")
    cache.mkdir()
    for key in ("a", "b"):
        (cache / f"{key}-cache").write_bytes(b"x")
    runtime.announce_compiling("svflow verify", 58, str(cache))
    assert capsys.readouterr().err == (
        f"svflow verify: compiling up to about 58 programs; compile cache: {cache} (2 "
        "programs of earlier runs, which load instead of compiling)\n")
    runtime.announce_compiling("svflow train", 42, None, "no compile cache")
    assert capsys.readouterr().err == "svflow train: compiling about 42 programs (no compile " \
                                      "cache)\n"


def test_exit_code_130_is_documented():
    assert runtime.EXIT_INTERRUPTED == 130 and 130 in runtime.EXIT_CODES
    assert "130 interrupted" in runtime.EPILOG
