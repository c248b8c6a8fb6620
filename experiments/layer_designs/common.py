"""What the parts of the layer-design study share: the default and CI settings of the
comparisons at width 64, the arms (a design and a norm position) and how each is built and
tuned, the verdict rule against a trained baseline, and a few formatting helpers.

**Collapse** (the mean cosine between a sequence's final token states, per seed) is measured
for every run; a seed at 0.99 or above is reported as collapsed and its arm is not ranked.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from svflow_jax.atomic import write_json

DEFAULT = dict(
    designs=["euler", "heun", "midpoint", "rk4", "geodesic-euler", "crouch-grossman3",
             "lie-trotter", "strang"],
    budget=12, seeds=3, steps=400, d_model=64, n_heads=4, d_head=16, d_ff=128, context=64,
    anchors=4, duration=12.0, batch_size=16, eval_every=50, eval_sequences=128,
    norms=["post", "pre"], baselines=["euler pre"], head_bias=True,
    lr_grid=[1e-3, 3e-3, 1e-2], tune_steps=150,
    rtols=[1e-1, 3e-2, 1e-2], recall_designs=[], recall_steps=300, throughput_repeats=5,
    memory_depths=[2, 8, 32],
)


QUICK = dict(
    designs=["euler", "heun"], budget=4, seeds=2, steps=12, d_model=16, n_heads=2, d_head=8,
    d_ff=32, context=16, anchors=2, duration=4.0, batch_size=8, eval_every=12,
    eval_sequences=16, norms=["post", "pre", "ngpt"], baselines=["euler pre"], head_bias=True,
    lr_grid=[3e-3, 1e-2],
    tune_steps=4, rtols=[1e-1], recall_designs=["euler"], recall_steps=4,
    throughput_repeats=2, memory_depths=[2, 8],
)


def arms(s) -> list[str]:
    """``"<design> <norm>"`` for every design and norm of ``s["norms"]`` it has: ``post``
    (on the sphere), ``pre`` (the rotation and geodesic designs have no pre-norm form) or
    ``ngpt`` (nGPT's normalised step on the sphere, :func:`arm_model`)."""
    from svflow_jax.solvers import catalogue

    out = []
    for design in s["designs"]:
        for norm in s["norms"]:
            try:
                catalogue.get(design).solver_for("post" if norm == "ngpt" else norm)
            except ValueError:
                continue
            out.append(f"{design} {norm}")
    return out + [f"{arm} per-layer" for arm in s["baselines"]]


def arm_model(model, arm: str, blocks: int):
    """The :class:`~svflow_jax.designs.DesignConfig` ``model`` with the arm's design and norm
    (``post``/``pre`` with the residual update, ``ngpt`` post-norm with nGPT's step) and
    ``blocks`` blocks; a ``per-layer`` arm has ``blocks`` layers of its own weights."""
    design, norm, *rest = arm.split()
    if norm == "ngpt":
        model = model.replace(design=design, norm_position="post", update="ngpt")
    else:
        model = model.replace(design=design, norm_position=norm, update="residual")
    if rest == ["per-layer"]:
        model = model.replace(weights="per_layer", num_anchors=blocks)
    return model.replace(num_steps=blocks)


def arm_config(base, arm: str, blocks: int, lr: float | None = None):
    """``base`` with the arm's model (:func:`arm_model`) and learning rate."""
    config = dataclasses.replace(base, model=arm_model(base.model, arm, blocks))
    return config if lr is None else dataclasses.replace(config, lr=lr)


def tuned_lr(s, tuning: dict, arm: str) -> float:
    """The grid's rate with the lowest validation loss after the short run, among the runs that
    did not collapse (all collapsed: the lowest loss anyway; the report shows them)."""
    from svflow_jax.training.compare import COLLAPSED

    rows = []
    for lr in s["lr_grid"]:
        if (arm, lr) in tuning:
            run = tuning[(arm, lr)]
            bpc = run["final"].get("val_bpc", math.nan)
            rows.append((not run["collapse"] < COLLAPSED, bpc if math.isfinite(bpc) else math.inf,
                         lr))
    return min(rows)[2]


def tune_run(base, arm: str, lr: float, folder: Path, plan: dict, progress: bool) -> dict:
    """One short run of the learning-rate sweep; a diverged run is recorded as such (and not
    retried on resume)."""
    from svflow_jax.training.compare import run_design
    from svflow_jax.training.loop import TrainingDiverged

    design = arm.split()[0]
    try:
        return run_design(arm_config(base, arm, plan[design], lr), design, plan[design], 0,
                          folder,
                          transfer_factors=(), progress=progress)
    except TrainingDiverged as err:
        summary = {"design": design, "seed": 0, "final": {}, "collapse": math.nan,
                   "diverged_at": err.step}
        write_json(folder / "summary.json", summary)
        return summary


def quick_recipe(config):
    """A CI-sized version of a recipe (same code paths, seconds to run)."""
    model = config.model.replace(d_model=16, n_heads=2, d_head=8, d_ff=32, num_steps=2,
                                 num_anchors=2, duration=2.0, context=16)
    return dataclasses.replace(config, model=model, steps=10, batch_size=4, warmup=1,
                               eval_every=5, eval_sequences=8, checkpoint_every=0)


def validation_curve(history, key):
    """``(step, tokens, seconds, value)`` of the validation rows."""
    return [(h["step"], h["tokens"], h["seconds"], h[key]) for h in history if key in h]


#: family-wise error rate of the verdicts against the baseline together (Bonferroni over arms)
ALPHA = 0.05


def versus_baseline(pairs: dict[str, list[float]], alpha: float = ALPHA) -> dict[str, dict]:
    """Each arm against the trained baseline from its per-seed differences ``arm - baseline``
    (validation bits per character, paired by seed): the two-sided Student-t interval at level
    ``1 - alpha / m``, Bonferroni over the ``m`` arms compared, decides ``better`` (below 0:
    fewer bits, the sign fixed before the run), ``worse`` (above 0) or ``unresolved`` (it
    holds 0, or fewer than 2 seeds)."""
    from svflow_jax.training.compare import interval

    m = sum(1 for v in pairs.values() if v)
    level = 1 - alpha / max(m, 1)
    out = {}
    for arm, values in pairs.items():
        if not values:
            continue
        mean, half = interval(values, level)
        verdict = ("better" if mean + half < 0 else "worse" if mean - half > 0
                   else "unresolved") if half == half else "unresolved"
        out[arm] = {"interval": [mean, half], "level": level, "comparisons": m,
                    "verdict": verdict}
    return out


def fmt(pair, digits=3) -> str:
    mean, half = pair
    if half != half:  # NaN
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half:.{digits}f}"
