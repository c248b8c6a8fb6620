"""The solver registry: its table (the one ``svflow verify`` used), evaluations per step counted
at run time against the tableau counts, registration, and import paths."""

from __future__ import annotations

import diffrax
import pytest
from fields_for_tests import RALSTON_SPEC, OrderlessRalston

from svflow_jax import solvers
from svflow_jax.solvers import (
    RK4,
    RKMK4,
    SOLVERS,
    CrouchGrossman3,
    GeodesicEuler,
    Retracted,
    RetractedEuler,
    SolverSpec,
    count_evaluations,
    get_solver,
    register,
    stays_on_sphere,
)

# name: (solver built, expected order, evaluations per step, step range, sizes, unretracted,
# description). The first eight are svflow_jax.verify's SOLVERS / STEP_RANGES / NUM_SIZES as
# they were before the registry; rkmk4 is new.
TABLE = {
    "euler": ((RetractedEuler,), 1, 1, (4, 512), 8, diffrax.Euler,
              "retracted Euler: the post-norm Transformer layer"),
    "heun": ((Retracted, diffrax.Heun), 2, 2, (4, 400), 8, diffrax.Heun,
             "retracted Heun (explicit trapezoid)"),
    "midpoint": ((Retracted, diffrax.Midpoint), 2, 2, (4, 400), 8, diffrax.Midpoint,
                 "retracted explicit midpoint"),
    "rk4": ((Retracted, RK4), 4, 4, (4, 400), 8, RK4,
            "retracted classical Runge-Kutta (ODE-Transformer RK4 block)"),
    "tsit5": ((Retracted, diffrax.Tsit5), 5, 6, (4, 400), 12, diffrax.Tsit5,
              "retracted Tsitouras 5(4)"),
    "dopri8": ((Retracted, diffrax.Dopri8), 8, 13, (12, 800), 16, diffrax.Dopri8,
               "retracted Dormand-Prince 8(7)"),
    "geodesic-euler": ((GeodesicEuler,), 1, 1, (4, 512), 8, None,
                       "Euler along great circles (exponential map)"),
    "crouch-grossman3": ((CrouchGrossman3,), 3, 3, (4, 400), 8, None,
                         "Crouch-Grossman Lie-group method (rotations only)"),
    "rkmk4": ((RKMK4,), 4, 4, (4, 200), 8, None, None),
}


def test_registry_table():
    assert list(SOLVERS) == list(TABLE)
    for name, (kind, order, evaluations, steps, sizes, unretracted, text) in TABLE.items():
        spec = SOLVERS[name]
        assert spec.name == name
        solver = spec.make()
        assert type(solver) is kind[0]
        if len(kind) == 2:
            assert type(solver.solver) is kind[1]
        assert stays_on_sphere(solver)
        assert (spec.expected_order, spec.evaluations_per_step) == (order, evaluations)
        assert solver.order(None) == order
        assert (spec.step_range, spec.num_sizes) == (steps, sizes)
        if unretracted is None:
            assert spec.unretracted is None
        else:
            plain = spec.unretracted()
            assert type(plain) is unretracted and not stays_on_sphere(plain)
        if text is not None:
            assert spec.description == text
        assert spec.description
    # the package re-exports the registry module's objects
    assert solvers.registry.SOLVERS is SOLVERS and solvers.get_solver is get_solver


@pytest.mark.parametrize("name", list(TABLE))
def test_evaluations_per_step_counted_at_run_time(name):
    """The tableau count (one per stage, less one for FSAL) against the field evaluations of a
    step after the first, counted while it runs."""
    spec = SOLVERS[name]
    assert count_evaluations(spec.make()) == spec.evaluations_per_step
    if spec.unretracted is not None:  # the same method off the sphere costs the same
        assert count_evaluations(spec.unretracted()) == spec.evaluations_per_step


def test_register_and_replace():
    spec = SolverSpec("test-ralston", lambda: Retracted(diffrax.Ralston()), 2, 2)
    try:
        assert register(spec) is spec and get_solver("test-ralston") is spec
        assert (spec.step_range, spec.num_sizes, spec.description, spec.unretracted) == (
            (4, 400), 8, "", None)
        with pytest.raises(ValueError, match="already registered"):
            register(SolverSpec("test-ralston", spec.make, 2, 2))
        other = SolverSpec("test-ralston", spec.make, 2, 2, description="again")
        assert register(other, replace=True) is other and SOLVERS["test-ralston"] is other
    finally:
        SOLVERS.pop("test-ralston", None)
    with pytest.raises(ValueError, match="already registered"):
        register(SOLVERS["euler"])
    with pytest.raises(ValueError, match="may not contain ':'"):
        register(SolverSpec("a:b", spec.make, 2, 2))
    with pytest.raises(ValueError, match="SolverSpec"):
        register("euler")
    for bad, message in [
        (dict(step_range=(10, 4)), r"step_range must be \(first, last\) with 1 <= first < last"),
        (dict(num_sizes=0), r"'x': num_sizes must be a positive int, got 0"),
        (dict(expected_order=1.5), r"'x': expected_order must be a positive int, got 1\.5"),
        (dict(evaluations_per_step=True), r"evaluations_per_step must be a positive int, got True"),
        (dict(name=""), r"SolverSpec\.name must be a non-empty string, got ''"),
    ]:
        with pytest.raises(ValueError, match=message):
            SolverSpec(**{**dict(name="x", make=spec.make, expected_order=2,
                                 evaluations_per_step=2), **bad})


def test_get_solver_from_import_paths():
    # a class: order from solver.order(None), evaluations counted, description = docstring
    spec = get_solver("svflow_jax.solvers:RKMK4")
    assert spec.name == "svflow_jax.solvers:RKMK4"
    assert (spec.expected_order, spec.evaluations_per_step) == (4, 4)
    assert spec.description == "Runge-Kutta-Munthe-Kaas method with the classical RK4 tableau."
    assert isinstance(spec.make(), RKMK4) and spec.unretracted is None
    # a zero-argument factory of Retracted(...): its inner solver is the unretracted form
    spec = get_solver("fields_for_tests:retracted_ralston")
    assert (spec.expected_order, spec.evaluations_per_step) == (2, 2)
    assert spec.description == "Ralston's second-order method, retracted."
    assert isinstance(spec.unretracted(), diffrax.Ralston)
    # a SolverSpec: as is
    assert get_solver("fields_for_tests:RALSTON_SPEC") is RALSTON_SPEC
    assert RALSTON_SPEC.name == "ralston"
    # an FSAL solver: Bogacki-Shampine costs 3 evaluations per step after the first (of 4)
    spec = get_solver("fields_for_tests:retracted_bosh3")
    assert (spec.expected_order, spec.evaluations_per_step) == (3, 3)
    # an instance: the description is its class's
    spec = get_solver("fields_for_tests:EULER_INSTANCE")
    assert (spec.expected_order, spec.evaluations_per_step) == (1, 1)
    assert spec.description.startswith("Retracted forward Euler")
    assert spec.make() is spec.make()


@pytest.mark.parametrize(
    "name, match",
    [
        ("nope", "unknown solver 'nope': registered solvers are euler, heun, midpoint"),
        ("no_such_module_xyz:Thing", "cannot import module"),
        ("svflow_jax.solvers:Nothing", "has no attribute"),
        (":RK4", "needs both a module and an attribute"),
        ("math:pi", "neither a SolverSpec nor a solver"),
        ("fields_for_tests:not_a_solver", "not a diffrax.AbstractSolver"),
        ("svflow_jax.solvers:solve", "calling it with no arguments failed"),
        ("diffrax:Heun", r"does not stay on the sphere; wrap it as Retracted\(diffrax.Heun\(\)\)"),
        ("fields_for_tests:OrderlessRalston", "must be a positive int, got None"),
        ("svflow_jax.solvers:RK4", "does not stay on the sphere"),
    ],
)
def test_get_solver_errors(name, match):
    with pytest.raises(ValueError, match=match) as info:
        get_solver(name)
    assert "euler" in str(info.value) and "rkmk4" in str(info.value)  # lists the registered


def test_get_solver_rejects_splittings_and_non_strings():
    # a splitting has no order without its terms (and needs two fields)
    with pytest.raises(ValueError, match="order cannot be read"):
        get_solver("fields_for_tests:strang_euler")
    with pytest.raises(ValueError, match="must be a string"):
        get_solver(RetractedEuler())
    assert OrderlessRalston().order(None) is None
