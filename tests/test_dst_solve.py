"""DST's fast solve against independent references: the per-unit public API, the old
full-re-solve bisection of the recall anchor, and the models' plain `predict`."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from sb_titan.balance.cost_model import AnalyticSpec, CostModel, LatencyObservation
from sb_titan.balance.cost_model.density import DensityModel
from sb_titan.balance.cost_model.recall import RecallModel
from sb_titan.balance.dst import DSTConfig, recalled_tokens, tune_budgets
from sb_titan.data.longtail import longtail_v1

REPO = Path(__file__).resolve().parents[1]
SPEC = AnalyticSpec(hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864, layers=24)


def longtail_units(n: int, seq: int = 16384, seed: int = 0) -> list:
    """PP-style units (one micro-batch each) filled greedily with longtail documents."""
    lengths = iter(longtail_v1(40 * n, seq, seed).tolist())
    units = []
    for _ in range(n):
        mb, room = [], seq
        while room > 0:
            take = min(int(next(lengths)), room)
            mb.append(take)
            room -= take
        units.append([mb])
    return units


def learned_model() -> CostModel:
    """A cost model whose density and recall models have learned something."""
    model = CostModel.analytic(SPEC)
    rng = np.random.default_rng(3)
    lens = rng.integers(64, 65536, 400)
    betas = rng.uniform(0.05, 0.99, 400)
    model.density_model.update(zip(betas, lens, np.clip(betas**1.4, 0.01, 1), strict=True))
    model.recall_model.update(zip(betas, lens, np.clip(betas + 0.04, 0, 1), strict=True))
    return model


def per_unit_budgets(units, model, cfg, anchor, policy):
    """The band rule one unit at a time through the public per-unit API."""
    out = []
    for unit in units:
        t = model.predict_budget(unit, cfg.beta0, policy)
        if t > anchor * (1 + cfg.p):
            out.append(model.budget_for(unit, anchor, policy, cfg.beta_min, cfg.beta0).beta)
        elif t < anchor * (1 - cfg.p):
            out.append(model.budget_for(unit, anchor, policy, cfg.beta0, cfg.beta_max).beta)
        else:
            out.append(cfg.beta0)
    return out


def bisected_recall_anchor(units, model, cfg, policy):
    """The previous solve, kept as the reference: 24 halvings, each a full re-solve of
    every unit's budget and a full re-prediction of the step's recall."""
    need = math.fsum(recalled_tokens(units, cfg.beta0, model)[1].tolist()) * (1 - 1e-12)

    def keeps(anchor):
        budgets = per_unit_budgets(units, model, cfg, anchor, policy)
        return math.fsum(recalled_tokens(units, budgets, model)[1].tolist()) >= need

    before = [model.predict_budget(u, cfg.beta0, policy) for u in units]
    lo, hi = min(before), max(before)
    if keeps(lo):
        return lo, lo, hi
    for _ in range(24):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if keeps(mid) else (mid, hi)
    return hi, min(before), max(before)


@pytest.mark.parametrize("policy", ["mass", "topk"])
@pytest.mark.parametrize("anchor", ["min", "mean", "median", "max"])
def test_statistic_anchors_equal_the_per_unit_solve_bit_for_bit(policy, anchor):
    model = learned_model()
    units = longtail_units(24)
    d = tune_budgets(units, model, DSTConfig(anchor=anchor, beta_min=0.3), policy)
    assert d.budgets == per_unit_budgets(units, model, d_cfg(anchor), d.anchor_s, policy)
    assert d.predicted_before == [model.predict_budget(u, 0.9, policy) for u in units]
    assert d.recalled_tokens == recalled_tokens(units, d.budgets, model)[1].tolist()


def d_cfg(anchor):
    return DSTConfig(anchor=anchor, beta_min=0.3)


@pytest.mark.parametrize(
    "policy, beta0, beta_min, seed",
    [("mass", 0.9, 0.5, 0), ("topk", 0.9, 0.5, 1), ("mass", 0.7, 0.2, 2), ("topk", 0.6, 0.1, 3)],
)
def test_recall_anchor_matches_the_full_resolve_bisection(policy, beta0, beta_min, seed):
    model = learned_model()
    units = longtail_units(16, seed=seed)
    cfg = DSTConfig(anchor="recall", beta0=beta0, beta_min=beta_min)
    d = tune_budgets(units, model, cfg, policy)
    ref, lo, hi = bisected_recall_anchor(units, model, cfg, policy)
    # Recall is kept exactly (checked on the exact budgets), so the anchor cannot lie
    # below the edge the reference brackets; above it, by at most the table's error.
    assert d.predicted_recall >= d.predicted_recall_static * (1 - 1e-12)
    assert ref - (hi - lo) * 2.0**-24 <= d.anchor_s <= ref + (hi - lo) * 2.0**-7
    assert np.allclose(
        d.budgets, per_unit_budgets(units, model, cfg, d.anchor_s, policy), rtol=0, atol=1e-12
    )


def test_models_predict_rows_are_bit_identical_to_predict():
    model = learned_model()
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2**21, 500).astype(np.float64)
    beta = rng.uniform(0.0, 1.0, 500)
    by_budget = RecallModel(beta_knots=20)
    by_budget.update([(b, n, 0.9) for b in (0.3, 0.55, 0.8) for n in (300, 5000, 90000)])
    models = (model.density_model, model.recall_model, DensityModel(), RecallModel(), by_budget)
    for m in models:
        rows = m.length_rows(lengths)
        assert (m.predict_rows(rows, beta) == m.predict(beta, lengths)).all()
        unit = rng.integers(0, 7, 500)
        per_unit = rng.uniform(0.0, 1.0, 7)
        assert (m.predict_rows(rows, per_unit, unit) == m.predict(per_unit[unit], lengths)).all()


def test_refit_in_one_batch_equals_the_per_observation_fit():
    model = learned_model()
    rng = np.random.default_rng(1)
    obs = [
        LatencyObservation(mb, list(rng.uniform(0.05, 1.0, len(mb))), float(rng.uniform(0.1, 2)))
        for (mb,) in longtail_units(32)
    ]
    obs.append(LatencyObservation([4096, 8], 0.5, float("nan")))  # skipped
    fast, slow = copy.deepcopy(model), copy.deepcopy(model)
    slow._terms_many = lambda work: tuple(
        np.array(col) for col in zip(*(slow._terms(lens, rho) for lens, rho in work), strict=True)
    )
    for _ in range(3):
        fast.refit(obs)
        slow.refit(obs)
    assert fast.state_dict() == slow.state_dict() and fast.n_refits == 3
    with pytest.raises(ValueError, match="densities must lie in"):
        fast.refit([([4096, 64], [0.5, 1.5], 1.0)])
    with pytest.raises(ValueError, match="1 densities for 2"):
        fast.refit([([4096, 64], [0.5], 1.0)])


def test_control_plane_bench_small_mode(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import control_plane
    finally:
        sys.path.remove(str(REPO / "bench"))
    out = tmp_path / "cp.json"
    args = ["--units", "8", "--repeats", "1", "--exchange-ranks", "2", "--out", str(out)]
    assert control_plane.main(args) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["units"] == 8 and row["gpus"] == 4
    # the exchange ran on 2 real gloo ranks (encode, one all-gather, decode)
    (exchange,) = result["exchange"]
    assert exchange["ranks"] == 2 and exchange["median_s"] > 0
    for a, s in row["dst_s"].items():
        assert s > 0 and row["step_s"][a] > 1.0  # a 3B model's 64K rows: seconds per step
        assert row["dst_over_step"][a] == pytest.approx(s / row["step_s"][a])
        ahead = row["sab_plan_s"] + s <= row["step_s"][a]  # the loader thread keeps up
        assert row["ahead_overlapped"][a] == ahead
        assert row["dst_within_target"][a] == (row["dst_over_step"][a] <= 0.01 or ahead)
    # per-document budgets after the recall anchor: timed, and overlapped only if all fit
    doc = row["sab_plan_s"] + row["dst_s"]["recall"] + row["doc_dst_s"]
    assert row["doc_dst_s"] > 0 and row["doc_dst_overlapped"] == (doc <= row["step_s"]["recall"])
    assert row["sab_plan_s"] > 0 and row["refit_s"] > 0 and row["publish_s"] > 0
