"""The layer-design study, one module per part of ``python experiments/layer_designs.py
--part X`` (that script is the command line):

* :mod:`.common`: the settings at width 64, the arms, tuning, the verdict rule;
* :mod:`.designs`: ``--part designs`` and ``--part ngpt``, every design at equal compute;
* :mod:`.depth`: ``--part depth``, a trained stack as a discretisation of its flow;
* :mod:`.baseline`: ``--part baseline``, the recipe of ``svflow train``;
* :mod:`.recipe`: ``--part recipe``, designs at the recipe's size, paired with it by seed;
* :mod:`.convergence`: ``--part convergence``, convergence in depth against an untrained
  control.

Results: ``docs/results/layer-designs.md`` and ``docs/results/baseline.md``.
"""
