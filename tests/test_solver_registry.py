"""The solver catalogue: its table (read by verify, sweep, train and inspect), evaluations per
step counted at run time against the tableau counts, tableau orders against diffrax's,
registration, import paths (the current folder first) and a method known to every command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import diffrax
import numpy as np
import pytest
from fields_for_tests import RALSTON_METHOD, OrderlessRalston

from svflow_jax import inspection
from svflow_jax.solvers import (
    CATALOGUE,
    RKMK4,
    CrouchGrossman3,
    GeodesicEuler,
    LieTrotter,
    Method,
    Retracted,
    RetractedEuler,
    Strang,
    WithinStep,
    catalogue,
    count_evaluations,
    register,
    stays_on_sphere,
)

ROOT = Path(__file__).resolve().parent.parent

# name: (sphere step, ambient step (None: on the sphere only), order, step range, sizes,
# block). The single-field rows are the former solver registry (svflow verify's sweeps); the
# splittings the former layer designs and verify's splitting claims.
TABLE = {
    "euler": ((RetractedEuler,), (WithinStep, diffrax.Euler), 1, (4, 512), 8, "parallel"),
    "heun": ((Retracted, diffrax.Heun), (WithinStep, diffrax.Heun), 2, (4, 400), 8, "parallel"),
    "midpoint": ((Retracted, diffrax.Midpoint), (WithinStep, diffrax.Midpoint), 2, (4, 400), 8,
                 "parallel"),
    "rk4": ((Retracted, diffrax.AbstractERK), (WithinStep, diffrax.AbstractERK), 4, (4, 400), 8,
            "parallel"),
    "tsit5": ((Retracted, diffrax.Tsit5), (WithinStep, diffrax.Tsit5), 5, (4, 400), 12,
              "parallel"),
    "dopri8": ((Retracted, diffrax.Dopri8), (WithinStep, diffrax.Dopri8), 8, (12, 800), 16,
               "parallel"),
    "geodesic-euler": ((GeodesicEuler,), None, 1, (4, 512), 8, "parallel"),
    "crouch-grossman3": ((CrouchGrossman3,), None, 3, (4, 400), 8, "parallel"),
    "rkmk4": ((RKMK4,), None, 4, (4, 200), 8, "parallel"),
    "lie-trotter": ((LieTrotter,), (LieTrotter,), 1, (4, 400), 8, "sequential"),
    "strang": ((Strang,), (Strang,), 1, (4, 400), 8, "macaron"),
    "strang-heun": ((Strang,), (Strang,), 2, (4, 400), 8, "macaron"),
    "strang-midpoint": ((Strang,), (Strang,), 2, (4, 400), 8, "macaron"),
}
# Evaluations per step after the first, from the tableaus (one per stage, less one for FSAL;
# checked against diffrax's tableaus below) and the methods' definitions: geodesic Euler one,
# Crouch-Grossman three stages, RKMK4 four; a splitting's sub-layer is half an evaluation:
# Lie-Trotter (A, F) = 1, Strang (F/2, A, F/2) = 1.5 with Euler sub-steps, twice that with
# two-stage sub-steps.
COSTS = {"euler": 1, "heun": 2, "midpoint": 2, "rk4": 4, "tsit5": 6, "dopri8": 13,
         "geodesic-euler": 1, "crouch-grossman3": 3, "rkmk4": 4, "lie-trotter": 1,
         "strang": 1.5, "strang-heun": 3, "strang-midpoint": 3}


def _tableau_cost(solver) -> int:
    tableau = solver.tableau
    return len(tableau.a_lower) + 1 - (1 if tableau.fsal else 0)


def test_catalogue_table():
    assert list(CATALOGUE) == list(TABLE)
    for name, (kind, ambient, order, steps, sizes, block) in TABLE.items():
        method = CATALOGUE[name]
        assert method.name == name and method.block == block
        assert isinstance(method.solver, kind[0]) and stays_on_sphere(method.solver)
        if len(kind) == 2:
            assert isinstance(method.solver.solver, kind[1])
        if not method.is_splitting:
            assert method.solver.order(None) == order
        assert method.order == order
        assert (method.step_range, method.num_sizes) == (steps, sizes)
        if ambient is None:
            assert method.ambient is None
            with pytest.raises(ValueError, match="no pre-norm form"):
                method.solver_for("pre")
        else:
            assert isinstance(method.ambient, ambient[0]) and not stays_on_sphere(method.ambient)
            if len(ambient) == 2:
                assert isinstance(method.ambient.solver, ambient[1])
            assert method.ambient is method.solver_for("pre")
        assert method.solver is method.solver_for("post")
        assert method.description
    assert inspection.scheme_names() == ["heun", "midpoint", "rk4", "tsit5", "dopri8"]


def test_tableau_costs_are_the_declared_tableaus():
    """The independent count, from the tableaus of the single-field Runge-Kutta methods."""
    for name in ("heun", "midpoint", "rk4", "tsit5", "dopri8"):
        assert _tableau_cost(CATALOGUE[name].solver.solver) == COSTS[name], name


@pytest.mark.parametrize("name", list(TABLE))
def test_evaluations_per_step_counted_at_run_time(name):
    """The count above against the field evaluations of a step after the first, counted while
    it runs (on the sphere and, where it exists, in R^d: the same method costs the same)."""
    method = CATALOGUE[name]
    assert method.evaluations_per_step == COSTS[name]
    if method.ambient is not None:
        assert count_evaluations(method.ambient) == COSTS[name]
    if method.adaptive is not None and name != "rk4":  # rk4's adaptive twin adds an FSAL stage
        assert count_evaluations(method.adaptive) == COSTS[name]


@pytest.mark.parametrize("solver", [diffrax.Heun, diffrax.Midpoint, diffrax.Ralston,
                                    diffrax.Bosh3])
def test_tableau_order_matches_diffrax(solver):
    assert catalogue.tableau_order(solver.tableau) == solver().order(None)


def test_tableau_order_of_classical_rk4_and_a_first_order_tableau():
    assert catalogue.tableau_order(catalogue.CLASSICAL_RK4) == 4
    assert catalogue.tableau_order(diffrax.Tsit5.tableau) == 4  # capped: declare higher orders
    # consistent (sum b = 1, which diffrax enforces) but b.c = 0.2, not 1/2: first order
    skewed = diffrax.ButcherTableau(c=np.array([1.0]), b_sol=np.array([0.8, 0.2]),
                                    b_error=np.zeros(2), a_lower=(np.array([1.0]),))
    assert catalogue.tableau_order(skewed) == 1
    assert catalogue.from_tableau(skewed, "skewed").order == 1


def test_register_and_replace():
    method = Method("test-ralston", Retracted(diffrax.Ralston()), order=2, cost=2)
    try:
        assert register(method) is method and catalogue.get("test-ralston") is method
        assert (method.step_range, method.num_sizes, method.description, method.ambient) == (
            (4, 400), 8, "", None)
        with pytest.raises(ValueError, match="already registered"):
            register(Method("test-ralston", method.solver, order=2, cost=2))
        other = Method("test-ralston", method.solver, description="again", order=2, cost=2)
        assert register(other, replace=True) is other and CATALOGUE["test-ralston"] is other
    finally:
        CATALOGUE.pop("test-ralston", None)
    with pytest.raises(ValueError, match="already registered"):
        register(CATALOGUE["euler"])
    with pytest.raises(ValueError, match="may not contain ':'"):
        register(Method("a:b", method.solver, order=2, cost=2))
    with pytest.raises(ValueError, match="register takes a Method"):
        register("euler")
    with pytest.raises(ValueError, match="give its order"):
        register(Method("no-order", Strang(RetractedEuler())))
    for bad, message in [
        (dict(step_range=(10, 4)), r"step_range must be \(first, last\) with 1 <= first < last"),
        (dict(num_sizes=0), r"'x': num_sizes must be a positive int, got 0"),
        (dict(order=1.5), r"'x': order must be a positive int, got 1\.5"),
        (dict(cost=True), r"'x': cost must be a positive number, got True"),
        (dict(name=""), r"name must be a non-empty string, got ''"),
    ]:
        with pytest.raises(ValueError, match=message):
            Method(**{**dict(name="x", solver=method.solver, order=2, cost=2), **bad})
    with pytest.raises(TypeError, match="diffrax solver"):
        Method("x", solver="euler")


def test_get_from_import_paths():
    # a class: order from solver.order(None), evaluations counted, description = docstring
    method = catalogue.get("svflow_jax.solvers:RKMK4")
    assert method.name == "svflow_jax.solvers:RKMK4"
    assert (method.order, method.evaluations_per_step) == (4, 4)
    assert method.description == "Runge-Kutta-Munthe-Kaas method with the classical RK4 tableau."
    assert isinstance(method.solver, RKMK4) and method.ambient is None
    # a zero-argument factory of Retracted(...): its inner solver is the unretracted form
    method = catalogue.get("fields_for_tests:retracted_ralston")
    assert (method.order, method.evaluations_per_step) == (2, 2)
    assert method.description == "Ralston's second-order method, retracted."
    assert isinstance(method.ambient, diffrax.Ralston)
    # a Method: as is
    assert catalogue.get("fields_for_tests:RALSTON_METHOD") is RALSTON_METHOD
    assert RALSTON_METHOD.name == "ralston"
    # an FSAL solver: Bogacki-Shampine costs 3 evaluations per step after the first (of 4)
    method = catalogue.get("fields_for_tests:retracted_bosh3")
    assert (method.order, method.evaluations_per_step) == (3, 3)
    # an instance: the description is its class's
    method = catalogue.get("fields_for_tests:EULER_INSTANCE")
    assert (method.order, method.evaluations_per_step) == (1, 1)
    assert method.description.startswith("Retracted forward Euler")
    assert method.solver is method.solver
    # a Butcher tableau: its order from the order conditions, its cost counted
    method = catalogue.get("svflow_jax.solvers.catalogue:CLASSICAL_RK4")
    assert (method.order, method.evaluations_per_step) == (4, 4)


@pytest.mark.parametrize(
    "name, match",
    [
        ("nope", "unknown method 'nope': registered methods are euler, heun, midpoint"),
        ("no_such_module_xyz:Thing", "cannot import method 'no_such_module_xyz:Thing': no "
                                     "module 'no_such_module_xyz'"),
        ("svflow_jax.solvers:Nothing", "has no attribute"),
        (":RK4", "needs both a module and an attribute"),
        ("math:pi", "neither a Method nor a solver"),
        ("fields_for_tests:not_a_solver", "not a diffrax.AbstractSolver"),
        ("svflow_jax.solvers:solve", "calling it with no arguments failed"),
        ("diffrax:Heun", r"does not stay on the sphere; wrap it as Retracted\(diffrax.Heun\(\)\)"),
        ("fields_for_tests:OrderlessRalston", "must be a positive int, got None"),
        ("svflow_jax.solvers:RK4", "does not stay on the sphere"),
    ],
)
def test_get_errors(name, match):
    with pytest.raises(ValueError, match=match) as info:
        catalogue.get(name)
    assert "euler" in str(info.value) and "rkmk4" in str(info.value)  # lists the registered


def test_get_rejects_splittings_by_path_and_non_strings():
    # a splitting has no order without its terms (and needs two fields): register a Method
    with pytest.raises(ValueError, match="order cannot be read"):
        catalogue.get("fields_for_tests:strang_euler")
    with pytest.raises(ValueError, match="must be a string"):
        catalogue.get(RetractedEuler())
    assert OrderlessRalston().order(None) is None


def test_a_factory_that_exits_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "exiting_solvers.py").write_text(
        "def make():\n    raise SystemExit(0)\n\nraise_at_import = None\n")
    (tmp_path / "exiting_module.py").write_text("raise SystemExit(0)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"calling it with no arguments failed \(SystemExit"):
        catalogue.get("exiting_solvers:make")
    with pytest.raises(ValueError, match="importing module 'exiting_module' raised SystemExit"):
        catalogue.get("exiting_module:anything")
    assert str(tmp_path) not in sys.path  # the current folder is searched, not left behind


def test_a_registered_method_is_known_to_every_command(capsys):
    """Registered once, a method is an order claim of verify, a design of train (and listed by
    --list-methods), a scheme of inspect and a solver of sweep."""
    from svflow_jax import cli
    from svflow_jax.claims import select
    from svflow_jax.designs import DesignConfig

    method = register(catalogue.from_tableau(diffrax.Ralston.tableau, "test-ralston",
                                             description="Ralston, retracted"))
    try:
        assert "order/test-ralston" in [c.name for c in select(["order/"])]
        assert cli.main(["train", "--list-methods"]) == 0
        assert ("test-ralston       order 2, parallel block, post- and pre-norm: Ralston, "
                "retracted") in capsys.readouterr().out
        assert DesignConfig(design="test-ralston", norm_position="pre").layer_design is method
        assert "test-ralston" in inspection.scheme_names()
        assert inspection.InspectOptions(schemes=("test-ralston",)).schemes == ("test-ralston",)
        assert catalogue.get("test-ralston") is method  # what sweep resolves
    finally:
        CATALOGUE.pop("test-ralston", None)
    with pytest.raises(ValueError, match="schemes: unknown methods"):
        inspection.InspectOptions(schemes=("test-ralston",))


def test_sweep_finds_a_users_solver_in_the_current_folder(tmp_path):
    """``svflow sweep --methods my_solvers:SSPRK3`` from the folder holding my_solvers.py, with
    the folder not on PYTHONPATH and not put on sys.path by Python (``-P``, as a console
    script): the module is found and its order (3, from the tableau) is measured; and
    ``--no-compile-cache`` writes nothing to the cache ``$JAX_COMPILATION_CACHE_DIR`` names."""
    (tmp_path / "my_solvers.py").write_text(
        "import diffrax\nimport numpy as np\n\n"
        "# Shu-Osher SSPRK3\n"
        "SSPRK3 = diffrax.ButcherTableau(c=np.array([1.0, 0.5]),\n"
        "    b_sol=np.array([1 / 6, 1 / 6, 2 / 3]), b_error=np.zeros(3),\n"
        "    a_lower=(np.array([1.0]), np.array([0.25, 0.25])))\n")
    cache = tmp_path / "jax-cache"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(cache))
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "svflow_jax", "sweep", "--methods", "my_solvers:SSPRK3",
         "--steps", "8", "64", "--num-sizes", "4", "--repeats", "1", "--tokens", "4",
         "--dim", "4", "--no-compile-cache", "--no-progress", "--out", "out"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "my_solvers:SSPRK3" in proc.stdout and "expected 3" in proc.stdout
    assert (tmp_path / "out" / "my_solvers_SSPRK3.json").is_file()
    assert not cache.exists() or not any(cache.iterdir())


def test_sweep_refuses_a_factory_that_exits(tmp_path):
    (tmp_path / "my_solvers.py").write_text("def SSPRK3():\n    raise SystemExit(0)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "svflow_jax", "sweep", "--methods", "my_solvers:SSPRK3",
         "--no-compile-cache", "--no-progress", "--out", "out"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "SystemExit" in proc.stderr and "my_solvers:SSPRK3" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_train_finds_a_users_design_in_the_current_folder(tmp_path, monkeypatch):
    """``svflow train --method my_designs:SSPRK3``: the same resolver as sweep, the current
    folder first (not on sys.path before, not left on it after)."""
    from svflow_jax import cli
    from svflow_jax.cli.train import config_from_args

    (tmp_path / "my_designs.py").write_text(
        "import diffrax\nimport numpy as np\n\n"
        "SSPRK3 = diffrax.ButcherTableau(c=np.array([1.0, 0.5]),\n"
        "    b_sol=np.array([1 / 6, 1 / 6, 2 / 3]), b_error=np.zeros(3),\n"
        "    a_lower=(np.array([1.0]), np.array([0.25, 0.25])))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_designs", raising=False)
    assert str(tmp_path) not in sys.path and "" not in sys.path[:1]
    args = cli.build_parser().parse_args(["train", "--method", "my_designs:SSPRK3"])
    design = config_from_args(args).model.layer_design
    assert (design.name, design.order, design.evaluations_per_step) == (
        "my_designs:SSPRK3", 3, 3)
    assert str(tmp_path) not in sys.path


def test_a_methods_evaluation_counts_are_measured_once(monkeypatch):
    """``evaluations(method, N, norm)`` of a (frozen) Method runs its probe program once per
    ``(N, norm)`` and keeps the count; the kept counts equal the bare solvers' own counts,
    which run every time."""
    import dataclasses

    from svflow_jax.solvers import catalogue

    probes = []
    real = catalogue._probe

    def counting(*args, **kwargs):
        probes.append(int(args[-1]))  # num_steps
        return real(*args, **kwargs)

    monkeypatch.setattr(catalogue, "_probe", counting)
    method = dataclasses.replace(catalogue.get("heun"))  # a fresh instance
    first = catalogue.evaluations(method, 3)
    assert catalogue.evaluations(method, 3) == first and len(probes) == 1
    pre = catalogue.evaluations(method, 3, "pre")
    catalogue.evaluations(method, 3, "pre")
    five = catalogue.evaluations(method, 5)
    assert len(probes) == 3
    assert (first, pre, five) == (catalogue.evaluations(method.solver_for("post"), 3),
                                  catalogue.evaluations(method.solver_for("pre"), 3),
                                  catalogue.evaluations(method.solver_for("post"), 5))
    assert len(probes) == 6  # bare solvers are counted every time
