"""The jaxtyping annotations of the public sphere and vMF functions hold at run time.

Each function is wrapped in ``jaxtyping.jaxtyped(typechecker=beartype)``, which checks every
argument and the return value against its annotation, shapes included (``"... d"`` must be the
same ``d`` in every argument, ``"... 1"`` a kept axis), and called on valid inputs: the checked
call returns exactly what the plain one does. A shape that contradicts the annotation is
rejected by the check, so the checks are active.

(Installing the check on the whole package, ``jaxtyping.install_import_hook("svflow_jax",
"beartype.beartype")``, is not done: on ``tests/test_sphere.py`` and ``tests/test_vmf.py`` it
cost 20% more time and rejected calls the functions accept on purpose, a Python float or an
integer array where ``Float[Array, ...]`` is annotated, before their own ``ValueError``.)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jaxtyping import TypeCheckError, jaxtyped

from svflow_jax import sphere, vmf

RNG = np.random.default_rng(0)
X = sphere.retract(jnp.asarray(RNG.standard_normal((2, 5, 4))))
Y = sphere.retract(jnp.asarray(RNG.standard_normal((2, 5, 4))))
V = sphere.project_tangent(X, jnp.asarray(0.3 * RNG.standard_normal((2, 5, 4))))
MU = sphere.retract(jnp.asarray(RNG.standard_normal(4)))

CALLS = {
    "dot": (sphere.dot, (X, Y)),
    "norm": (sphere.norm, (V,)),
    "project_tangent": (sphere.project_tangent, (X, V)),
    "retract": (sphere.retract, (X + V,)),
    "soft_retract": (sphere.soft_retract, (X + V, 1e-3)),
    "exp_map": (sphere.exp_map, (X, V)),
    "log_map": (sphere.log_map, (X, Y)),
    "geodesic_distance": (sphere.geodesic_distance, (X, Y)),
    "plane_rotation": (sphere.plane_rotation, (X[0, 0], V[0, 0], Y)),
    "norm_drift": (sphere.norm_drift, (X + V,)),
    "off_sphere": (sphere.off_sphere, (X + V,)),
    "logpdf": (vmf.logpdf, (X, MU, 2.0)),
    "euclidean_score": (vmf.euclidean_score, (X, MU, 2.0)),
    "riemannian_score": (vmf.riemannian_score, (X, MU, 2.0)),
}


def checked(fn):
    return jaxtyped(typechecker=beartype)(fn)


@pytest.mark.parametrize("name", CALLS)
def test_annotations_hold_on_valid_inputs(name):
    fn, args = CALLS[name]
    np.testing.assert_array_equal(checked(fn)(*args), fn(*args))


@pytest.mark.parametrize(("fn", "args"), [
    (sphere.project_tangent, (X, V[..., :3])),  # "... d" and "... d": two different d
    (sphere.geodesic_distance, (X, Y[..., :3])),
    (sphere.exp_map, (X[0, 0, 0], V[0, 0, 0])),  # a scalar has no axis d
])
def test_a_contradicting_shape_is_rejected(fn, args):
    with pytest.raises(TypeCheckError, match="Type-check error whilst checking the parameters"):
        checked(fn)(*args)
