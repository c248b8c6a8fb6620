"""``--part convergence``: does a trained stack converge to a flow, measured against controls?

A ratio near ``2^p`` between successive differences of the final states (Richardson) is what
any method of order ``p`` gives on any smooth field, trained or not. So the same sequence is
measured on four arms of one architecture (Euler, post-norm, Chebyshev weights in depth,
width 64, ``N`` blocks at the budget): **untrained** (the initial weights of each seed, the
control), trained at **one depth** ``N``, at **two depths** ``N`` and ``2N`` every step, and at a
**random depth** per step out of ``N``, ``2N``, ``4N``. Each is run at ``N/2`` to ``32 N``
blocks (past 256), and reported with the depths it was trained at marked: the Richardson
ratios, the block count from which they stay within :data:`~svflow_jax.training.compare.ORDER_BAND`
of ``2^p`` (:func:`~svflow_jax.training.compare.order_regime`), the angle of the trained
depth's states from the Richardson limit (degrees) and the loss there against the limit's.
Writes ``convergence/report.md`` and ``convergence/results.json``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from svflow_jax.atomic import write_json, write_text

from .common import fmt

__all__ = ["CONVERGENCE", "CONVERGENCE_QUICK", "run_convergence", "convergence_report"]

#: the part's settings: Euler at the depth study's size; block counts N * multiples. An arm
#: is ``None`` (untrained) or the TrainConfig depth fields it sets, as multiples of N
CONVERGENCE = dict(design="euler", norm="post", seeds=3, steps=400, lr=3e-3,
                   multiples=[0.5, 1, 2, 4, 8, 16, 32],
                   arms={"untrained": None, "one depth": {},
                         "depths N and 2N": {"extra_depths": (2,)},
                         "random depth of N, 2N, 4N": {"random_depths": (2, 4)}})

CONVERGENCE_QUICK = dict(CONVERGENCE, seeds=2, steps=6, multiples=[1, 2, 4, 8])


def _depths(spec: dict, n: int) -> dict[str, tuple[int, ...]]:
    """An arm's TrainConfig depth fields in blocks (its multiples of ``n`` times ``n``)."""
    return {field: tuple(k * n for k in multiples) for field, multiples in spec.items()}


def _trained_depths(spec: dict | None, n: int) -> list[int]:
    """The block counts an arm's loss was taken at (none for the untrained control)."""
    if spec is None:
        return []
    return [n, *(d for depths in _depths(spec, n).values() for d in depths)]


def run_convergence(out: Path, s: dict, c: dict, *, progress: bool = True) -> dict:
    """Trains the arms of ``c`` at each seed (resumable: a finished run is read back), measures the
    Richardson sequence of each at ``c["multiples"]`` times ``N`` blocks and the validation loss
    there, and writes ``results.json`` and ``report.md`` in ``out``."""
    from svflow_jax.designs import DesignConfig
    from svflow_jax.solvers import catalogue
    from svflow_jax.training import TrainConfig
    from svflow_jax.training.compare import (
        depth_transfer,
        equal_compute_steps,
        extrapolate,
        interval,
        order_regime,
        richardson,
    )
    from svflow_jax.training.tasks import get_task
    from svflow_jax.training.trainer import initial_model, train

    start = time.perf_counter()
    design, order = c["design"], catalogue.get(c["design"]).order
    n = equal_compute_steps([design], s["budget"])[design]
    model = DesignConfig(design=design, num_steps=n, d_model=s["d_model"],
                         n_heads=s["n_heads"], d_head=s["d_head"], d_ff=s["d_ff"],
                         context=s["context"], weights="chebyshev", num_anchors=s["anchors"],
                         duration=s["duration"], norm_position=c["norm"],
                         head_bias=s["head_bias"])
    base = TrainConfig(model=model, task="austen", steps=c["steps"], batch_size=s["batch_size"],
                       lr=c["lr"], warmup=max(1, c["steps"] // 20), eval_every=s["eval_every"],
                       eval_sequences=s["eval_sequences"], log_every=s["eval_every"])
    task = get_task("austen", s["context"])
    multiples = c["multiples"]
    blocks = [max(1, int(round(m * n))) for m in multiples]
    one = multiples.index(1)
    rows = []
    for arm, spec in c["arms"].items():
        per_seed = []
        for seed in range(c["seeds"]):
            print(f"[{time.perf_counter() - start:6.0f}s] convergence {arm}, seed {seed}",
                  flush=True)
            if spec is None:  # the control: the weights train() would start from
                lm = initial_model(dataclasses.replace(base, seed=seed), task)
            else:
                config = dataclasses.replace(base, seed=seed, **_depths(spec, n))
                folder = out / f"{arm.split()[0]}-seed{seed}"  # resumed, or read back
                lm = train(config, folder, progress=progress).model
            r = richardson(lm, task, multiples, s["eval_sequences"])
            bpc = [row["bpc"] for row in depth_transfer(lm, task, multiples,
                                                        s["eval_sequences"])]
            per_seed.append({"richardson": r, "bpc": bpc,
                             "bpc_limit": float(extrapolate(bpc[-2], bpc[-1], order))})
        ratios = np.array([p["richardson"]["ratios"] for p in per_seed])
        angles = np.array([p["richardson"]["angles_to_limit"] for p in per_seed])
        bpc = np.array([p["bpc"] for p in per_seed])
        limit = np.array([p["bpc_limit"] for p in per_seed])
        mean_ratios = ratios.mean(axis=0)
        rows.append({
            "arm": arm, "trained_depths": _trained_depths(spec, n),
            "ratios": [interval(ratios[:, j]) for j in range(ratios.shape[1])],
            "order_from": order_regime(list(mean_ratios), blocks, order),
            "angle_at_N": interval(angles[:, one]),
            "angles": [interval(angles[:, j]) for j in range(angles.shape[1])],
            "bpc": [interval(bpc[:, j]) for j in range(bpc.shape[1])],
            "bpc_limit": interval(limit),
            "loss_above_limit_percent": interval(100 * (bpc[:, one] / limit - 1)),
            "per_seed": per_seed})
    results = {"settings": {**c, "budget": s["budget"], "N": n, "blocks": blocks,
                            "order": order},
               "rows": rows, "seconds": time.perf_counter() - start}
    write_json(out / "results.json", results)
    write_text(out / "report.md", convergence_report(s, c, results))
    return results


def convergence_report(s: dict, c: dict, results: dict) -> str:
    """The report: what was shown per arm (order from which block count, angle and loss of the
    trained depth against the limit), then the Richardson and loss tables with the trained
    depths in bold."""
    st = results["settings"]
    n, blocks, p = st["N"], st["blocks"], st["order"]
    lines = ["# Convergence in depth against an untrained control", ""]
    for r in results["rows"]:
        start = (f"at order {p} (ratios within {100 * _band():.0f}% of {2 ** p}) from "
                 f"{r['order_from']} blocks on" if r["order_from"] is not None else
                 f"not at order {p} by {blocks[-1]} blocks (the finest ratio is outside "
                 f"{100 * _band():.0f}% of {2 ** p})")
        trained = ", ".join(map(str, r["trained_depths"])) or "no depth (initial weights)"
        lines.append(
            f"* **{r['arm']}** (trained at {trained}): the states converge {start}; at N = {n} "
            f"they are {fmt(r['angle_at_N'], 1)} degrees from the limit, and the loss there "
            f"differs from the limit's by {fmt(r['loss_above_limit_percent'], 1)}% "
            f"({fmt(r['bpc'][blocks.index(n)])} against {fmt(r['bpc_limit'])} bits/char).")
    lines += [
        "", f"Euler, {c['norm']}-norm, Chebyshev weights through {s['anchors']} anchors on "
        f"[0, {s['duration']:g}], width {s['d_model']}, N = {n} blocks, {c['steps']} AdamW steps "
        f"at peak {c['lr']:g}, {c['seeds']} seeds (mean and 95% Student t half-width); "
        f"{s['eval_sequences']} validation sequences. Run time {results['seconds']:.0f} s.", "",
        "Legend: block counts in **bold** are the depths an arm's loss was taken at in "
        "training. Ratio k is `e_k / e_(k+1)`, `e_k` the RMS distance between the final states "
        "at the k-th and (k+1)-th block counts; an order-p discretisation of one flow has "
        f"ratios near 2^p. \"Order from\" is the smallest block count from which every ratio "
        f"(mean over seeds) lies within {100 * _band():.0f}% of 2^p. The limit is Richardson's "
        f"extrapolation from the two finest block counts; the angle is the RMS over tokens of "
        "the angle between a state's direction and the limit's. These are descriptions with "
        "intervals, not tests.", "",
        "| arm | trained at | " + " | ".join(
            f"ratio {a}/{b}/{c2}"
            for a, b, c2 in zip(blocks, blocks[1:], blocks[2:], strict=False)) + " |",
        "|---|---|" + "---|" * (len(blocks) - 2)]
    for r in results["rows"]:
        lines.append(f"| {r['arm']} | {_trained(r)} | "
                     + " | ".join(fmt(x, 2) for x in r["ratios"]) + " |")
    lines += ["", "| arm | trained at | " + " | ".join(f"{b} blocks" for b in blocks)
              + " | limit |", "|---|---|" + "---|" * (len(blocks) + 1)]
    for r in results["rows"]:
        t = r["trained_depths"]
        cells = [f"**{fmt(x)}**" if b in t else fmt(x)
                 for b, x in zip(blocks, r["bpc"], strict=True)]
        lines.append(f"| {r['arm']} bits/char | {_trained(r)} | " + " | ".join(cells)
                     + f" | {fmt(r['bpc_limit'])} |")
        cells = [f"**{fmt(x, 1)}**" if b in t else fmt(x, 1)
                 for b, x in zip(blocks, r["angles"], strict=True)]
        lines.append(f"| {r['arm']} degrees from the limit | {_trained(r)} | "
                     + " | ".join(cells) + " | 0 |")
    return "\n".join(lines) + "\n"


def _trained(row: dict) -> str:
    return ", ".join(map(str, row["trained_depths"])) or "-"


def _band() -> float:
    from svflow_jax.training.compare import ORDER_BAND

    return ORDER_BAND


