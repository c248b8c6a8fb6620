"""``--part depth``: is a trained stack a convergent discretisation of one flow?

Euler and Heun with Chebyshev weights (a smooth path through the anchors), trained at the
budget's ``N`` blocks alone ("one depth") or at ``N`` and ``extra`` N at once ("two depths",
``TrainConfig.extra_depths``), against a per-layer baseline; each trained model is evaluated at
1/2 to 8 times its blocks with the Richardson ratios of the final states, and with adaptive
depth at several tolerances. Writes ``depth/report.md`` and ``depth/results.json``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np

from svflow_jax.atomic import write_json, write_text

from .common import fmt

#: the depth part: weights smooth in depth (Chebyshev path through the anchors), trained at
#: the budget's blocks N alone ("one depth") or at N and ``extra`` N at once ("two depths",
#: TrainConfig.extra_depths), then run at other block counts
DEPTH = dict(designs=["euler", "heun"], norm="post", seeds=3, steps=400, lr=3e-3, extra=2,
             factors=[0.5, 2.0, 4.0, 8.0], multiples=[1, 2, 4, 8],
             rtols=[0.1, 0.03, 0.01, 0.003])


DEPTH_QUICK = dict(designs=["euler"], norm="post", seeds=2, steps=6, lr=3e-3, extra=2,
                   factors=[0.5, 2.0], multiples=[1, 2, 4], rtols=[0.1])


def run_depth(out: Path, s: dict, d: dict, *, progress: bool = True) -> dict:
    """Is a trained stack a convergent discretisation of one flow? Each design of ``d`` with
    Chebyshev weights, trained at one depth and at two, then: validation at ``factors`` times
    the blocks, and the Richardson ratios of its final states at ``multiples`` (``2^p`` for a
    discretisation of order ``p``). Writes ``results.json`` and ``report.md`` in ``out``."""
    from svflow_jax.designs import DesignConfig
    from svflow_jax.solvers import catalogue
    from svflow_jax.training import TrainConfig
    from svflow_jax.training.compare import equal_compute_steps, interval, run_design

    start = time.perf_counter()
    plan = equal_compute_steps(d["designs"], s["budget"])
    model = DesignConfig(d_model=s["d_model"], n_heads=s["n_heads"], d_head=s["d_head"],
                         d_ff=s["d_ff"], context=s["context"], weights="chebyshev",
                         num_anchors=s["anchors"], duration=s["duration"],
                         norm_position=d["norm"], head_bias=s["head_bias"])
    base = TrainConfig(model=model, task="austen", steps=d["steps"], batch_size=s["batch_size"],
                       lr=d["lr"], warmup=max(1, d["steps"] // 20), eval_every=s["eval_every"],
                       eval_sequences=s["eval_sequences"], log_every=s["eval_every"])
    # extra depth multiple per arm; None: the per-layer baseline (N layers of their own weights)
    arms = (("one depth", 0), (f"depths N and {d['extra']}N", d["extra"]),
            ("per-layer weights", None))
    runs = {}
    for seed in range(d["seeds"]):
        for design in d["designs"]:
            n = plan[design]
            for arm, extra in arms:
                kind = {0: "one", None: "perlayer"}.get(extra, "two")
                folder = out / f"{design}-{kind}-seed{seed}"
                print(f"[{time.perf_counter() - start:6.0f}s] depth {design} {arm} seed {seed}",
                      flush=True)
                if extra is None:
                    config = dataclasses.replace(base, model=base.model.replace(
                        weights="per_layer", num_anchors=n))
                else:
                    config = dataclasses.replace(base, extra_depths=(extra * n,) if extra else ())
                runs[(design, arm, seed)] = run_design(
                    config, design, n, seed, folder, transfer_factors=d["factors"],
                    richardson_multiples=d["multiples"], rtols=d["rtols"], progress=progress)
    rows = []
    for design in d["designs"]:
        for arm, _ in arms:
            seeds = [runs[(design, arm, k)] for k in range(d["seeds"])]
            one = [r["final"]["val_bpc"] for r in seeds]
            at = {"1": interval(one)}
            change = {}
            for i, f in enumerate(d["factors"]):
                vals = [r["transfer"][i]["bpc"] for r in seeds]
                at[f"{f:g}"] = interval(vals)
                change[f"{f:g}"] = interval([100 * (v / o - 1) for v, o in zip(vals, one,
                                                                                strict=True)])
            ratios = np.array([r["richardson"]["ratios"] for r in seeds])
            rows.append({"design": design, "arm": arm, "blocks": plan[design],
                         "parameters": seeds[0]["parameters"],
                         "order": catalogue.get(design).order, "val_bpc": at,
                         "change_percent": change,
                         "richardson_ratios": [interval(ratios[:, j])
                                               for j in range(ratios.shape[1])],
                         "collapse": [r["collapse"] for r in seeds],
                         "adaptive": [{"rtol": a["rtol"],
                                       "evaluations": interval([r["adaptive"][i]["evaluations"]
                                                                for r in seeds]),
                                       "bpc": interval([r["adaptive"][i]["loss"] / math.log(2)
                                                        for r in seeds])}
                                      for i, a in enumerate(seeds[0]["adaptive"])],
                         "train_seconds": interval([r["train_seconds"] for r in seeds])})
    results = {"settings": {**d, "budget": s["budget"]}, "rows": rows,
               "seconds": time.perf_counter() - start}
    write_json(out / "results.json", results)
    _depth_report(out, s, d, results)
    return results


def _depth_report(out: Path, s: dict, d: dict, results: dict) -> None:
    m = d["multiples"]
    lines = [
        "# A trained stack as a discretisation of its flow", "",
        f"Width {s['d_model']}, Chebyshev weights through {s['anchors']} anchors on [0, "
        f"{s['duration']:g}], {d['norm']}-norm, head bias {'on' if s['head_bias'] else 'off'}, "
        f"{d['steps']} AdamW steps at peak {d['lr']:g}, {d['seeds']} seeds (95% Student t "
        f"intervals). Trained at N blocks (the budget of {s['budget']} evaluations), or at N and "
        f"{d['extra']}N at once (the loss is their mean: {1 + d['extra']} times the training "
        f"compute), against the per-layer baseline (N blocks of their own weights, the standard "
        f"Transformer, trained at N). Validation bits per character at multiples of N, its "
        f"change against N in percent, and the Richardson ratios e_k / e_(k+1) of the final "
        f"states, e_k = RMS |y(m_k N) - y(m_(k+1) N)| over m = "
        f"{', '.join(f'{v:g}' for v in m)}: a convergent discretisation of order p has "
        f"ratios near 2^p. Run time {results['seconds']:.0f} s.",
        "",
        "| design (order) | training | N | parameters | " + " | ".join(
            f"bpc at {f:g}N (change)" for f in [1.0, *d["factors"]]) + " | Richardson ratios | "
        "final-state cosine | train s |",
        "|---|---|---|---|" + "---|" * (len(d["factors"]) + 1) + "---|---|---|",
    ]
    for r in results["rows"]:
        cells = [fmt(r["val_bpc"]["1"])]
        for f in d["factors"]:
            key = f"{f:g}"
            cells.append(f"{fmt(r['val_bpc'][key])} ({r['change_percent'][key][0]:+.1f}%)")
        ratios = ", ".join(fmt(x, 2) for x in r["richardson_ratios"])
        cosine = " ".join(f"{c:.2f}" for c in r["collapse"])
        lines.append(f"| {r['design']} ({r['order']}) | {r['arm']} | {r['blocks']} | "
                     f"{r['parameters']} | "
                     + " | ".join(cells) + f" | {ratios} | {cosine} | "
                     f"{r['train_seconds'][0]:.0f} |")
    lines += ["", "Adaptive depth (diffrax's PID controller on the embedded error estimate, "
              "per input sequence): mean evaluations and bits per character at each tolerance.",
              "", "| design | training | rtol | evaluations | bits/char |", "|---|---|---|---|---|"]
    for r in results["rows"]:
        for a in r["adaptive"]:
            lines.append(f"| {r['design']} | {r['arm']} | {a['rtol']:g} | "
                         f"{fmt(a['evaluations'], 1)} | {fmt(a['bpc'])} |")
    write_text(out / "report.md", "\n".join(lines) + "\n")
