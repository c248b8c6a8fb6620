"""The convergence-in-depth measurements (:mod:`svflow_jax.training.compare`): Richardson's
limit, the angle from it and the block count from which the ratios are ``2^p``, against closed
forms; and the study's report on both sides of the order band."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from svflow_jax.training.compare import ORDER_BAND, extrapolate, limit_angles, order_regime

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))


@pytest.mark.parametrize("order", [1, 2, 4])
def test_extrapolation_is_exact_for_an_error_c_h_to_the_p(order):
    """y(h) = y* + C h^p: the limit from h and h/2 is y* to round-off."""
    limit, c, h = 0.7, 3.0, 0.25
    coarse, fine = limit + c * h ** order, limit + c * (h / 2) ** order
    assert extrapolate(coarse, fine, order) == pytest.approx(limit, abs=1e-15)


def test_limit_angles_are_the_closed_form_angles_of_a_turning_state():
    """A unit state at angle phi_k = phi* + c / N_k from a fixed direction (the first-order
    error of a rotation): the angles from the limit are c / N_k (degrees), each token alike."""
    rng = np.random.default_rng(0)
    base = np.linalg.qr(rng.normal(size=(5, 5)))[0][:, :2]  # two orthonormal directions, d = 5
    blocks, c, star = [8, 16, 32, 64], 0.2, 0.3

    def state(n):
        phi = star + c / n
        y = np.cos(phi) * base[:, 0] + np.sin(phi) * base[:, 1]
        return np.tile(y, (3, 1))  # three tokens

    angles = limit_angles([state(n) for n in blocks], order=1)
    # the chord-linear limit of the last two differs from the true limit by O((c/N)^2)
    expected = [np.degrees(c / n) for n in blocks]
    assert angles == pytest.approx(expected, abs=np.degrees((c / blocks[-2]) ** 2))
    assert angles[-1] < angles[0] / 4


@pytest.mark.parametrize(("ratios", "expected"), [
    ([2.0, 2.0, 2.0], 8),               # order 1 throughout
    ([3.0, 2.05, 1.95], 16),            # from the second ratio on
    ([2.0, 3.0, 2.0], 32),              # a ratio outside the band breaks the run
    ([2.0, 2.0, 2.5], None),            # the finest is outside
])
def test_order_regime_reads_the_first_block_count_of_the_run_of_ratios_in_the_band(ratios,
                                                                                   expected):
    assert order_regime(ratios, [8, 16, 32, 64, 128], 1) == expected


def test_order_regime_boundary_is_the_band_on_each_side():
    """Just inside and just outside ``ORDER_BAND`` of ``2^p``, above and below, for p = 1, 2."""
    for p in (1, 2):
        target = 2.0 ** p
        inside = [target * (1 + ORDER_BAND) * (1 - 1e-9), target * (1 - ORDER_BAND) * (1 + 1e-9)]
        outside = [target * (1 + ORDER_BAND) * (1 + 1e-6), target * (1 - ORDER_BAND) * (1 - 1e-6)]
        for r in inside:
            assert order_regime([r], [4, 8, 16], p) == 4, (p, r)
        for r in outside:
            assert order_regime([r], [4, 8, 16], p) is None, (p, r)


def test_the_report_states_the_order_regime_or_its_absence_and_marks_trained_depths():
    from layer_designs.convergence import CONVERGENCE, convergence_report

    blocks = [6, 12, 24, 48]
    row = dict(arm="one depth", trained_depths=[12], ratios=[(2.0, 0.1), (2.0, 0.1)],
               angle_at_N=(3.0, 0.5), angles=[(6.0, 1), (3.0, 0.5), (1.5, 0.2), (0.7, 0.1)],
               bpc=[(3.4, 0.1), (3.3, 0.1), (3.31, 0.1), (3.31, 0.1)], bpc_limit=(3.31, 0.1),
               loss_above_limit_percent=(-0.3, 0.2), order_from=6)
    none = dict(row, arm="untrained", trained_depths=[], order_from=None)
    s = dict(anchors=4, duration=12.0, d_model=64, eval_sequences=128)
    results = {"settings": {"N": 12, "blocks": blocks, "order": 1}, "rows": [row, none],
               "seconds": 1.0}
    text = convergence_report(s, dict(CONVERGENCE, steps=400), results)
    assert "from 6 blocks on" in text
    assert f"not at order 1 by {blocks[-1]} blocks" in text
    assert "**3.300 ± 0.100**" in text or "**3.30" in text  # the trained depth in bold
    assert f"{100 * ORDER_BAND:.0f}%" in text
    assert not math.isnan(row["angle_at_N"][0])


def test_order_regime_band_is_closed():
    """A ratio exactly ``band`` away from ``2^p`` is inside (``|r / 2^p - 1| <= band``):
    bands and ratios exact in binary, 2.5 / 2 - 1 = 0.25 and 3 / 4 - 1 = -0.25."""
    assert order_regime([2.5], [4, 8, 16], 1, band=0.25) == 4
    assert order_regime([3.0], [4, 8, 16], 2, band=0.25) == 4
    assert order_regime([math.nextafter(2.5, 3)], [4, 8, 16], 1, band=0.25) is None


def test_the_quick_part_marks_the_trained_depths_of_each_arm(tmp_path):
    """``--part convergence`` at CI size, one seed: every arm measured at every block count,
    the untrained control from ``train``'s own starting weights, the trained depths of each
    arm as its TrainConfig asked (N; N and 2N; N, 2N and 4N)."""
    from layer_designs.common import QUICK
    from layer_designs.convergence import CONVERGENCE_QUICK, run_convergence

    c = dict(CONVERGENCE_QUICK, seeds=1, steps=2, multiples=[1, 2, 4])
    results = run_convergence(tmp_path, QUICK, c, progress=False)
    n = results["settings"]["N"]
    rows = {r["arm"]: r for r in results["rows"]}
    assert [rows[a]["trained_depths"] for a in c["arms"]] == [[], [n], [n, 2 * n],
                                                              [n, 2 * n, 4 * n]]
    assert all(len(r["ratios"]) == 1 and len(r["bpc"]) == 3 for r in rows.values())
    assert (tmp_path / "report.md").read_text().count("**") > 0
