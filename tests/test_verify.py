"""The ``svflow`` command line: option checks, ``--quick``, sweeps of a user's solver, the
end-to-end ``svflow verify --quick`` (on a subset of the claims) and the compilation cache."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import svflow_jax
from svflow_jax import cli
from svflow_jax.cli import verify as cli_verify
from svflow_jax.xla_settings import QUICK_FLAGS, use_project_flags

BAD_OPTIONS = [
    (["verify", "--tokens", "0"], "--tokens"),
    (["verify", "--layers", "0"], "--layers"),
    (["verify", "--repeats", "0"], "--repeats"),
    (["verify", "--seed", "-1"], "--seed"),
    (["verify", "--step-scale", "nan"], "--step-scale"),
    (["verify", "--step-scale", "-1"], "--step-scale"),
    (["verify", "--step-scale", "0"], "--step-scale"),
    (["verify", "--t1", "nan"], "--t1"),
    (["verify", "--strength", "nan"], "--strength"),
    (["verify", "--dim", "1"], "dim"),
    (["verify", "--dim", "7"], "dim"),
    (["verify", "--only", "no-such-claim"], "no claim matches"),
    (["sweep", "--num-sizes", "0"], "--num-sizes"),
    (["sweep", "--num-sizes", "2"], "num-sizes"),
    (["sweep", "--steps", "6", "4"], "FIRST < LAST"),
    (["sweep", "--steps", "4", "6", "--num-sizes", "8"], "do not fit"),
    (["sweep", "--methods", "nonsense"], "nonsense"),
    (["sweep", "--methods", "no_such_module:Thing"], "no_such_module"),
    (["inspect", "smollm2-135m-instruct", "--window", "1"],
     "argument --window: must be a whole number >= 2, got '1'"),
    (["inspect", "smollm2-135m-instruct", "--substeps", "2", "1"],
     "argument --substeps: must be a whole number >= 2, got '1'"),
]


@pytest.mark.parametrize(("argv", "named"), BAD_OPTIONS)
def test_bad_options_exit_2_naming_the_option_before_compiling(argv, named, capsys):
    start = time.perf_counter()
    with pytest.raises(SystemExit, match="^2$") as err:  # SystemExit's text is its code
        cli.main(argv + ["--no-compile-cache"])
    assert err.value.code == 2
    assert named in capsys.readouterr().err
    assert time.perf_counter() - start < 5  # nothing compiled


def test_help_exits_0():
    for command in ("verify", "sweep"):
        with pytest.raises(SystemExit, match="^0$") as err:
            cli.main([command, "--help"])
        assert err.value.code == 0


def test_version(capsys):
    with pytest.raises(SystemExit, match="^0$") as err:
        cli.main(["--version"])
    assert err.value.code == 0
    assert capsys.readouterr().out.strip() == f"svflow-jax {svflow_jax.__version__}"


def test_quick_sets_defaults_but_explicit_options_win():
    parser = cli.build_parser()
    quick = cli.flow_options(parser.parse_args(["verify", "--quick"]), quick=True)
    assert (quick.tokens, quick.dim, quick.layers, quick.repeats) == (4, 8, 4, 1)
    mixed = cli.flow_options(parser.parse_args(["verify", "--quick", "--dim", "12"]),
                             quick=True)
    assert mixed.dim == 12 and mixed.tokens == 4
    plain = cli.flow_options(parser.parse_args(["verify"]))
    assert (plain.tokens, plain.dim) == (8, 16)


def readme_example() -> str:
    """The README's "Your own layer design" module, verbatim (so the two cannot drift)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    start = readme.index("# my_layers.py")
    return readme[start:readme.index("```", start)]


USER_SOLVER = readme_example() + """
WRONG = Method("ralston-claimed-3", RALSTON.solver, order=3)
"""


def test_sweep_measures_a_users_solver_and_resumes(tmp_path, monkeypatch, capsys):
    """The README's example: a solver in the user's own module, swept by import path; the
    requested step range is honoured; a second run resumes from the JSON files; exit 1 when
    the order misses its expectation."""
    (tmp_path / "my_layers.py").write_text(textwrap.dedent(USER_SOLVER))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "sweep"
    argv = ["sweep", "--methods", "my_layers:RALSTON", "euler", "--steps", "16", "256",
            "--num-sizes", "5", "--tokens", "4", "--dim", "8", "--repeats", "1",
            "--no-progress", "--out", str(out)]
    assert cli.main(argv) == 0
    row = json.loads((out / "ralston.json").read_text())
    assert [p["num_steps"] for p in row["points"]][0] == 16
    assert row["points"][-1]["num_steps"] == 256 and len(row["points"]) == 5
    assert abs(row["fitted_order"] - 2) <= 0.15 and row["passed"] is True
    assert cli.main(argv) == 0  # resumed: nothing recomputed
    assert "ralston" in capsys.readouterr().out
    wrong = argv.copy()
    wrong[2] = "my_layers:WRONG"
    wrong[-1] = str(tmp_path / "wrong")
    assert cli.main(wrong) == 1


def test_verify_adds_the_order_claim_of_a_users_method(user_folder, capsys):
    """``svflow verify --methods my_layers:RALSTON`` from the folder holding the README's
    module: the claim ``order/ralston`` is added, listed, run and reported; a name that clashes
    with a registered claim is refused."""
    (user_folder / "my_layers.py").write_text(textwrap.dedent(USER_SOLVER))
    assert cli.main(["verify", "--methods", "my_layers:RALSTON", "--list"]) == 0
    assert "order/ralston" in capsys.readouterr().out
    argv = ["verify", "--quick", "--methods", "my_layers:RALSTON", "--only", "order/ralston",
            "--no-progress", "--out", "out"]
    assert cli.main(argv) == 0
    [claim] = json.loads((user_folder / "out" / "summary.json").read_text())["claims"]
    assert (claim["name"], claim["passed"], claim["headline"]) == (
        "order/ralston", True, "fitted_order")
    assert "| `order/ralston` |" in (user_folder / "out" / "report.md").read_text()
    (user_folder / "my_layers.py").write_text(
        textwrap.dedent(USER_SOLVER) + 'RK4 = Method("rk4", RALSTON.solver, order=2)\n')
    sys.modules.pop("my_layers")  # read the edited module
    with pytest.raises(SystemExit, match="^2$"):
        cli.main(["verify", "--methods", "my_layers:RK4", "--list"])
    assert "two claims are named 'order/rk4'" in capsys.readouterr().err


def _run_cli(args, env_extra=None, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "svflow_jax", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


# One claim of each family that has a figure of the report (convergence and work-precision,
# stacks), plus exactness and splitting: the second run of the end-to-end test, from the cache.
E2E_CLAIMS = ["exactness/postnorm-projected", "order/heun", "splitting/lie-trotter",
              "standard-layer/stack-order"]
# XLA programs `svflow verify --quick` may compile on an empty cache in a fresh process (58 when
# this bound was set: a claim's loop over sizes, variants or step counts is one program; a
# program per operation or per step count would show here first).
MAX_QUICK_COMPILATIONS = 60


def test_verify_quick_end_to_end_then_from_the_cache(tmp_path):
    """The main job on its quick defaults, every claim, in a fresh process on an empty
    compilation cache: it passes, writes every file and compiles at most
    ``MAX_QUICK_COMPILATIONS`` programs; a second run of a subset of the claims, on the same
    cache, loads its programs from it and writes only those claims' figures."""
    args = ["verify", "--quick", "--no-progress", "--cache-dir", str(tmp_path / "c")]
    out = tmp_path / "verify"
    proc = _run_cli(args + ["--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # said before the first compilation (the cache is empty): how many, and where they go
    assert proc.stderr.startswith(f"svflow verify: compiling about {cli_verify.PROGRAMS} "
                                  f"programs (cached for next time in {tmp_path / 'c'})\n")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schema_version"] == 2 and summary["passed"] is True
    names = [c["name"] for c in summary["claims"]]
    assert summary["config"]["only"] is None and set(E2E_CLAIMS) <= set(names)
    assert len(names) > 40 and {n.split("/")[0] for n in names} >= {
        "exactness", "order", "splitting", "drift", "standard-layer", "prenorm", "gains"}
    comp = summary["compile"]
    assert comp["cache_hits"] == 0  # the cache was empty
    assert 0 < comp["xla_compilations"] <= MAX_QUICK_COMPILATIONS
    # thread-seconds: the claims' own seconds add up to busy_s, and every traced or compiled
    # program belongs to a claim, so compiling cannot exceed it (it did exceed total_s, the
    # wall time, when claims ran in two threads, and run_s was then clamped to 0)
    assert comp["busy_s"] == pytest.approx(sum(c["seconds"] for c in summary["claims"]))
    assert 0 < comp["compile_total_s"] <= comp["busy_s"]
    assert comp["run_s"] == pytest.approx(comp["busy_s"] - comp["compile_total_s"])
    assert comp["run_s"] > 0
    assert summary["config"]["xla_flags"] == os.environ.get("XLA_FLAGS", QUICK_FLAGS)
    env = summary["environment"]  # of the process that ran the claims
    assert env["xla_flags"] == summary["config"]["xla_flags"]
    assert env["cpu_count"] == os.cpu_count() and env["svflow_jax"] == svflow_jax.__version__
    for name in ("report.md", "config.json", "claims.csv", "convergence.png",
                 "work_precision.png", "stacks.png", "drift.png"):
        assert (out / name).exists(), name
    report = (out / "report.md").read_text()
    assert "PASS" in report and f"svflow-jax {svflow_jax.__version__}" in report
    # the conclusion first, with the quick run's caveat; no absolute path of this machine
    assert report.splitlines()[2].startswith(f"**PASSED**: all {len(summary['claims'])} claims")
    assert "A quick run (n = 4 tokens, d = 8, 4 layers)" in report.splitlines()[2]
    for name in ("report.md", "summary.json"):
        assert str(tmp_path) not in (out / name).read_text(), name

    again_out = tmp_path / "again"
    proc = _run_cli(args + ["--only", *E2E_CLAIMS, "--out", str(again_out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.startswith("svflow verify: compiling up to about ")  # some cached
    assert f"; compile cache: {tmp_path / 'c'} (" in proc.stderr.splitlines()[0]
    again = json.loads((again_out / "summary.json").read_text())
    assert again["passed"] is True
    assert [c["name"] for c in again["claims"]] == E2E_CLAIMS
    assert again["compile"]["cache_hits"] >= 1
    assert again["compile"]["xla_compilations"] < comp["xla_compilations"]
    for name in ("convergence.png", "work_precision.png", "stacks.png"):
        assert (again_out / name).exists(), name
    assert not (again_out / "drift.png").exists()  # figures only for the claims present


def test_enable_compilation_cache_moves_an_open_cache(tmp_path):
    """Called after programs were compiled (JAX then has its cache folder open, or none), the
    next program lands in the new folder, not in the old one (conftest.py gives the next test
    the suite's cache back)."""
    import jax
    import jax.numpy as jnp

    from svflow_jax.xla_settings import enable_compilation_cache

    jax.jit(lambda x: x + 1.0)(jnp.ones(2)).block_until_ready()  # the current cache is open
    assert enable_compilation_cache(tmp_path / "moved") == tmp_path / "moved"

    def moved_cache_probe(x):
        return x * 3.5 - 2.0

    jax.jit(moved_cache_probe)(jnp.arange(4.0)).block_until_ready()
    assert len(list((tmp_path / "moved").glob("jit_moved_cache_probe-*-cache"))) == 1


def test_prune_cache_deletes_the_programs_used_longest_ago(tmp_path):
    """The cache bound (:func:`svflow_jax.xla_settings.prune_cache`, the suite's at each run and a
    command's when it opens its folder): programs go, least recently used first (access or
    modification time, the later), with their jax access-time files, until the rest fit; other
    files stay."""
    from svflow_jax.xla_settings import CACHE_LIMIT, prune_cache

    assert CACHE_LIMIT == 2 * 1024**3
    used = {"a": 100, "b": 400, "c": 200, "d": 300}  # key: the time it was last used
    for key, when in used.items():
        program = tmp_path / f"jit_f-{key}-cache"
        program.write_bytes(b"x" * 10)
        (tmp_path / f"jit_f-{key}-atime").write_bytes(b"t")
        os.utime(program, (when, 50) if key != "c" else (50, when))  # c: written at 200
    (tmp_path / "other").write_bytes(b"y" * 100)
    assert prune_cache(tmp_path, limit=25) == 2  # a (100), then c (200)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "jit_f-b-atime", "jit_f-b-cache", "jit_f-d-atime", "jit_f-d-cache", "other"]
    assert prune_cache(tmp_path, limit=20) == 0  # 20 bytes left: within the limit
    assert prune_cache(tmp_path, limit=0) == 2 and not list(tmp_path.glob("*-cache"))


def test_enable_compilation_cache_trims_a_folder_it_opens(tmp_path):
    """A folder the call opens is trimmed to ``limit`` first (the program used longest ago
    goes); called again on the folder now in force, nothing more is deleted."""
    import jax

    from svflow_jax.xla_settings import enable_compilation_cache

    folder = tmp_path / "cache"
    folder.mkdir()
    for key, when in {"old": 100, "new": 200}.items():
        (folder / f"jit_f-{key}-cache").write_bytes(b"x" * 10)
        os.utime(folder / f"jit_f-{key}-cache", (when, when))
    enable_compilation_cache(folder, limit=15)
    assert [p.name for p in folder.glob("*-cache")] == ["jit_f-new-cache"]
    assert jax.config.jax_compilation_cache_dir == str(folder)
    enable_compilation_cache(folder, limit=0)  # already in force: left alone
    assert [p.name for p in folder.glob("*-cache")] == ["jit_f-new-cache"]


def test_project_flags_for_quick_runs_unless_the_user_set_their_own(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert use_project_flags(quick=True) == QUICK_FLAGS == os.environ["XLA_FLAGS"]
    monkeypatch.delenv("XLA_FLAGS")
    assert use_project_flags(quick=False) == "" and "XLA_FLAGS" not in os.environ
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_xnnpack=true")
    assert use_project_flags(quick=True) == "--xla_cpu_use_xnnpack=true"
