"""DST: anchors, direction of adjustment, clamping, tolerance and determinism."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from sb_titan.cost_model import AnalyticSpec, CostModel
from sb_titan.dst import DSTConfig, tune_budgets

# Qwen2.5-0.5B dims on a FLOP-based profile: a known formula, not a measurement.
SPEC = AnalyticSpec(hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864, layers=24)
# PP-style units (one micro-batch each): one long document vs rows of short ones.
SKEWED = [[[32768]], [[16384, 16384]], [[8192] * 4], [[2048] * 16], [[512] * 64]]


@pytest.fixture
def model() -> CostModel:
    return CostModel.analytic(SPEC)


def stat(values, anchor):
    return {"min": min, "max": max, "mean": np.mean, "median": np.median}[anchor](values)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"anchor": "avg"}, "anchor"),
        ({"policy": "dense"}, "policy"),
        ({"p": -0.1}, "p"),
        ({"p": math.nan}, "p"),
        ({"beta_min": 0.0}, "beta_min"),
        ({"beta_max": 1.5}, "beta_max"),
        ({"beta0": 0.4}, "beta_min <= beta0"),
        ({"beta_min": 0.95}, "beta_min <= beta0"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DSTConfig(**kwargs)


@pytest.mark.parametrize("anchor", ["min", "mean", "median", "max"])
def test_each_anchor_pulls_units_outside_the_band_onto_it(model, anchor):
    cfg = DSTConfig(anchor=anchor, policy="topk", beta0=0.6, beta_min=0.05, beta_max=1.0)
    d = tune_budgets(SKEWED, model, cfg)
    before = np.array(d.predicted_before)
    assert d.anchor_s == pytest.approx(stat(before, anchor), rel=1e-12)
    bounds = (cfg.beta_min, cfg.beta_max)
    for t_before, t_after, budget in zip(before, d.predicted_after, d.budgets, strict=True):
        if abs(t_before / d.anchor_s - 1) <= cfg.p:
            assert budget == cfg.beta0 and t_after == t_before
        elif budget not in bounds:
            assert t_after == pytest.approx(d.anchor_s, rel=0.01)
    assert d.n_raised + d.n_lowered > 0


def test_max_anchor_only_raises_and_min_anchor_only_lowers(model):
    up = tune_budgets(SKEWED, model, DSTConfig(anchor="max", policy="topk"))
    assert up.n_lowered == 0 and up.n_raised > 0
    assert all(b >= 0.9 for b in up.budgets)
    down = tune_budgets(SKEWED, model, DSTConfig(anchor="min", policy="topk", beta_min=0.05))
    assert down.n_raised == 0 and down.n_lowered > 0
    assert all(b <= 0.9 for b in down.budgets)


def test_clamping_is_counted_both_ways(model):
    cfg = DSTConfig(policy="topk", beta0=0.9, beta_min=0.85, beta_max=0.95)
    d = tune_budgets(SKEWED, model, cfg)
    assert d.budgets[0] == cfg.beta_min  # the 32K document cannot reach the mean
    assert d.budgets[-1] == cfg.beta_max  # the short documents cannot either
    assert d.n_clamped == d.n_raised + d.n_lowered == len(SKEWED)
    assert d.predicted_after[0] > d.anchor_s > d.predicted_after[-1]


def test_tolerance_zero_adjusts_every_unit_and_large_tolerance_none(model):
    d = tune_budgets(SKEWED, model, DSTConfig(policy="topk", p=0.0, beta_min=0.05))
    assert d.n_raised + d.n_lowered == len(SKEWED)
    d = tune_budgets(SKEWED, model, DSTConfig(policy="topk", p=10.0))
    assert d.budgets == [0.9] * len(SKEWED) and d.n_raised == d.n_lowered == 0


@pytest.mark.parametrize("anchor", ["min", "mean", "median", "max"])
def test_equal_latencies_keep_beta0_even_at_zero_tolerance(model, anchor):
    units = [[[4096, 1000, 3]]] * 3 + [[[3, 1000, 4096]]]
    d = tune_budgets(units, model, DSTConfig(anchor=anchor, p=0.0))
    assert d.budgets == [0.9] * 4 and d.n_clamped == 0


def test_disabled_gives_beta0(model):
    d = tune_budgets(SKEWED, model, DSTConfig(enabled=False, beta0=0.7))
    assert d.budgets == [0.7] * len(SKEWED)
    assert d.predicted_after == d.predicted_before
    assert d.n_raised == d.n_lowered == d.n_clamped == 0


@pytest.mark.parametrize("policy", ["topk", "mass"])
def test_dst_brings_max_over_mean_toward_one(model, policy):
    cfg = DSTConfig(policy=policy, beta0=0.5, beta_min=0.05, beta_max=1.0)
    d = tune_budgets(SKEWED, model, cfg)
    assert d.imbalance_before > 1.5
    assert 1.0 <= d.imbalance_after < 1.0 + (d.imbalance_before - 1.0) / 2
    assert max(d.predicted_after) < max(d.predicted_before)


def test_units_of_several_micro_batches_share_one_budget(model):
    # DP-style units: a rank's micro-batches, whose summed time matters.
    units = [[[32768], [16384, 16384]], [[2048] * 16, [512] * 64], [[8192] * 4, [4096] * 8]]
    cfg = DSTConfig(policy="topk", beta0=0.5, beta_min=0.05)
    d = tune_budgets(units, model, cfg)
    for unit, t in zip(units, d.predicted_before, strict=True):
        per_mb = sum(model.predict_budget(mb, 0.5, "topk") for mb in unit)
        assert t == pytest.approx(per_mb, rel=1e-12)
    for unit, beta, t in zip(units, d.budgets, d.predicted_after, strict=True):
        assert model.predict_budget(unit, beta, "topk") == pytest.approx(t, rel=1e-12)
    # The heavy rank is lowered onto the anchor, the middle one raised onto it; the
    # all-short rank cannot reach it even dense (clamped at beta_max).
    assert d.budgets[0] < 0.5 < d.budgets[2] < 1.0 == d.budgets[1]
    assert d.predicted_after[0] == pytest.approx(d.anchor_s, rel=0.01)
    assert d.predicted_after[2] == pytest.approx(d.anchor_s, rel=0.01)
    assert (d.n_lowered, d.n_raised, d.n_clamped) == (1, 2, 1)


def test_decision_is_deterministic_and_digest_tracks_budgets(model):
    cfg = DSTConfig(policy="mass", beta_min=0.1)
    a = tune_budgets(SKEWED, model, cfg)
    b = tune_budgets([list(u) for u in SKEWED], CostModel.analytic(SPEC), cfg)
    assert a == b and a.digest() == b.digest()
    assert a.digest() == hashlib.sha1(np.asarray(a.budgets, "<f8").tobytes()).hexdigest()
    model.density_model.update([(0.9, 32768, 0.2)] * 4)
    assert tune_budgets(SKEWED, model, cfg).digest() != a.digest()


def test_rejects_empty_units(model):
    with pytest.raises(ValueError, match="unit"):
        tune_budgets([], model, DSTConfig())
    with pytest.raises(ValueError, match="unit"):
        tune_budgets([[[1024]], []], model, DSTConfig())
