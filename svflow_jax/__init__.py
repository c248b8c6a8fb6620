"""svflow-jax: Score-based Variational Flow on the sphere, in JAX.

Where things live:

* ``svflow_jax.sphere``   geometry of S^{d-1}: projection, retraction, exp/log, rotations.
* ``svflow_jax.vmf``      the von Mises-Fisher distribution: normaliser, scores, sampling.
* ``svflow_jax.flow``     SVFlow vector fields in probability words: attention as a vMF-kernel
                          posterior, MoE/FFN as relaxed scores, time-dependent parameters.
* ``svflow_jax.solvers``  diffrax solvers that stay on the sphere.
"""

__version__ = "0.1.0"
