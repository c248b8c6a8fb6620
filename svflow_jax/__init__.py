"""svflow-jax: Score-based Variational Flow on the sphere, in JAX.

Where things live:

* ``svflow_jax.sphere``          geometry of S^{d-1}: projection, retraction, exp/log, rotations.
* ``svflow_jax.vmf``             the von Mises-Fisher distribution: normaliser, scores, sampling.
* ``svflow_jax.flow``            SVFlow vector fields in probability words: attention as a
                                 vMF-kernel posterior (``flow/attention.py``), MoE/FFN as relaxed
                                 scores, time-dependent parameters.
* ``svflow_jax.solvers``         diffrax solvers that stay on the sphere.
* ``svflow_jax.transformer``     a standard Flax NNX Transformer, in deep-learning words.
* ``svflow_jax.correspondence``  the only module speaking both: weights <-> flow parameters.
* ``svflow_jax.claims``          measurements of the claim "a Transformer is an Euler step".
* ``svflow_jax.verify``, ``report``, ``cli``   the ``svflow verify`` / ``svflow sweep`` command.
* ``svflow_jax.fitting``         convergence orders with 95% intervals.
"""

__version__ = "0.1.0"
