"""DST: anchors, direction of adjustment, clamping, tolerance and determinism."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from sb_titan.balance.cost_model import AnalyticSpec, CostModel
from sb_titan.balance.dst import DSTConfig, recalled_tokens, sensitive_recall, tune_budgets

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
    cfg = DSTConfig(anchor=anchor, beta0=0.6, beta_min=0.05, beta_max=1.0)
    d = tune_budgets(SKEWED, model, cfg, "topk")
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
    up = tune_budgets(SKEWED, model, DSTConfig(anchor="max"), "topk")
    assert up.n_lowered == 0 and up.n_raised > 0
    assert all(b >= 0.9 for b in up.budgets)
    down = tune_budgets(SKEWED, model, DSTConfig(anchor="min", beta_min=0.05), "topk")
    assert down.n_raised == 0 and down.n_lowered > 0
    assert all(b <= 0.9 for b in down.budgets)


def test_clamping_is_counted_both_ways(model):
    cfg = DSTConfig(beta0=0.9, beta_min=0.85, beta_max=0.95)
    d = tune_budgets(SKEWED, model, cfg, "topk")
    assert d.budgets[0] == cfg.beta_min  # the 32K document cannot reach the mean
    assert d.budgets[-1] == cfg.beta_max  # the short documents cannot either
    assert d.n_clamped == d.n_raised + d.n_lowered == len(SKEWED)
    assert d.predicted_after[0] > d.anchor_s > d.predicted_after[-1]


def test_tolerance_zero_adjusts_every_unit_and_large_tolerance_none(model):
    d = tune_budgets(SKEWED, model, DSTConfig(p=0.0, beta_min=0.05), "topk")
    assert d.n_raised + d.n_lowered == len(SKEWED)
    d = tune_budgets(SKEWED, model, DSTConfig(p=10.0), "topk")
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
    cfg = DSTConfig(beta0=0.5, beta_min=0.05, beta_max=1.0)
    d = tune_budgets(SKEWED, model, cfg, policy)
    assert d.imbalance_before > 1.5
    assert 1.0 <= d.imbalance_after < 1.0 + (d.imbalance_before - 1.0) / 2
    assert max(d.predicted_after) < max(d.predicted_before)


def test_units_of_several_micro_batches_share_one_budget(model):
    # DP-style units: a rank's micro-batches, whose summed time matters.
    units = [[[32768], [16384, 16384]], [[2048] * 16, [512] * 64], [[8192] * 4, [4096] * 8]]
    cfg = DSTConfig(beta0=0.5, beta_min=0.05)
    d = tune_budgets(units, model, cfg, "topk")
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
    cfg = DSTConfig(beta_min=0.1)
    a = tune_budgets(SKEWED, model, cfg, "mass")
    b = tune_budgets([list(u) for u in SKEWED], CostModel.analytic(SPEC), cfg, "mass")
    assert a == b and a.digest() == b.digest()
    assert a.digest() == hashlib.sha1(np.asarray(a.budgets, "<f8").tobytes()).hexdigest()
    model.density_model.update([(0.9, 32768, 0.2)] * 4)
    assert tune_budgets(SKEWED, model, cfg, "mass").digest() != a.digest()


def test_rejects_empty_units(model):
    with pytest.raises(ValueError, match="unit"):
        tune_budgets([], model, DSTConfig())
    with pytest.raises(ValueError, match="unit"):
        tune_budgets([[[1024]], []], model, DSTConfig())


# ---- the recall-neutral anchor ------------------------------------------------------------


def reference_budgets(units, model, cfg, anchor, policy="mass"):
    """The band rule straight from the docstring, one unit at a time (public API)."""
    before = [model.predict_budget(u, cfg.beta0, policy) for u in units]
    out = []
    for unit, t in zip(units, before, strict=True):
        if t > anchor * (1 + cfg.p):
            out.append(model.budget_for(unit, anchor, policy, cfg.beta_min, cfg.beta0).beta)
        elif t < anchor * (1 - cfg.p):
            out.append(model.budget_for(unit, anchor, policy, cfg.beta0, cfg.beta_max).beta)
        else:
            out.append(cfg.beta0)
    return before, out


def sensitive(units, block_size=64):
    return np.array([sum(max(0, n - 2 * block_size) for mb in u for n in mb) for u in units])


@pytest.mark.parametrize("policy", ["topk", "mass"])
def test_recall_anchor_is_the_fastest_target_that_keeps_recall(model, policy):
    cfg = DSTConfig(anchor="recall", beta0=0.7, beta_min=0.2, beta_max=1.0)
    d = tune_budgets(SKEWED, model, cfg, policy)

    def recalled(budgets):  # sensitive tokens x the mass they keep, summed over documents
        r = model.recall_model.predict
        return sum(
            max(0, n - 128) * float(r(b, n))
            for u, b in zip(SKEWED, budgets, strict=True)
            for mb in u
            for n in mb
        )

    keeps = lambda budgets: recalled(budgets) >= recalled([cfg.beta0] * len(SKEWED)) * (1 - 1e-9)  # noqa: E731
    before, ref = reference_budgets(SKEWED, model, cfg, d.anchor_s, policy)
    assert np.allclose(d.budgets, ref, atol=1e-9) and keeps(d.budgets)
    assert d.predicted_recall >= d.predicted_recall_static - 1e-9
    # Brute force over a grid of anchors: no lower one keeps recall.
    grid = np.linspace(min(before), max(before), 400)
    lowest = next(a for a in grid if keeps(reference_budgets(SKEWED, model, cfg, a, policy)[1]))
    step = grid[1] - grid[0]
    assert lowest - step <= d.anchor_s <= lowest + 1e-9 * lowest
    # It removes the straggler; against the mean anchor it is lower exactly when the
    # mean anchor keeps recall too.
    assert max(d.predicted_after) < max(d.predicted_before)
    mean = tune_budgets(SKEWED, model, DSTConfig(**{**_fields(cfg), "anchor": "mean"}), policy)
    keeps_too = mean.predicted_recall >= mean.predicted_recall_static - 1e-12
    assert (d.anchor_s <= mean.anchor_s) == keeps_too


def test_recall_anchor_keeps_recall_where_the_mean_anchor_loses_it(model):
    # DP-style: the heavy rank holds long documents, the light one mostly short ones,
    # so the seconds the mean anchor moves buy fewer recall points on the light rank.
    units = [[[32768], [16384, 16384]], [[8192] * 4, [4096] * 4 + [128] * 128]]
    base = {"beta0": 0.8, "beta_min": 0.3, "beta_max": 1.0}
    mean = tune_budgets(units, model, DSTConfig(anchor="mean", **base))
    recall = tune_budgets(units, model, DSTConfig(anchor="recall", **base))
    assert mean.predicted_recall < mean.predicted_recall_static - 0.01
    assert recall.predicted_recall >= recall.predicted_recall_static - 1e-9
    assert max(mean.predicted_after) < max(recall.predicted_after) < max(recall.predicted_before)


def _fields(cfg):
    return {k: getattr(cfg, k) for k in ("beta0", "beta_min", "beta_max", "p")}


def test_recall_anchor_without_sensitive_tokens_is_the_minimum(model):
    units = [[[128] * 30], [[100] * 4]]  # no document past two blocks: budgets change nothing
    d = tune_budgets(units, model, DSTConfig(anchor="recall"))
    assert d.predicted_recall == d.predicted_recall_static == 1.0
    assert d.anchor_s == min(d.predicted_before)


@pytest.mark.parametrize("policy", ["topk", "mass"])
def test_selection_recall_is_bounded_by_the_budget_model(policy):
    """The premise of the recall anchor: tokens in a document's first two blocks keep
    all their estimated mass, the others at least beta."""
    import torch

    from sb_titan.attention.selection import select_blocks

    lens = [[640, 128, 192, 64, 1024], [2048]]
    doc_id = torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lens]
    )
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 2048, 32, generator=g), torch.randn(2, 2, 2048, 32, generator=g)
    q[..., :4] += 3.0  # a shared direction: uneven, content-dependent mass
    for beta in (0.3, 0.6, 0.9):
        _, stats = select_blocks(q, k, doc_id, beta, policy=policy, block_size=64)
        s = sensitive([[row] for row in lens])
        bound = (2048 - s + s * beta) / 2048
        assert (stats.recall.double().numpy() >= bound - 1e-5).all(), (beta, stats.recall)


def test_measured_recall_inverts_to_the_recall_model():
    model = CostModel.analytic(SPEC)
    lens = [4096, 1000, 200, 1, 1]  # 1s: padding, not attending
    attending, recalled = recalled_tokens([[lens]], 0.7, model)
    assert attending[0] == 5296
    length, kept = sensitive_recall(lens, recalled[0] / attending[0], 64)
    per_doc = model.recall_model.predict(0.7, [4096, 1000, 200])
    want = (per_doc * [4096 - 128, 1000 - 128, 200 - 128]).sum() / (5296 - 3 * 128)
    assert length == 4096 and kept == pytest.approx(want, rel=1e-9)
    assert sensitive_recall([100, 128, 1], 0.9, 64) is None  # nothing past two blocks


def test_a_learned_recall_model_makes_the_recall_anchor_more_careful():
    """Short documents already keep most of their mass at beta0, so raising them buys
    little: once measured, the recall anchor cuts the long-document unit less."""
    units = [[[32768], [16384, 16384]], [[8192] * 4, [4096] * 4 + [128] * 128]]
    cfg = DSTConfig(anchor="recall", beta0=0.8, beta_min=0.3)
    model = CostModel.analytic(SPEC)
    prior = tune_budgets(units, model, cfg, "mass")
    model.recall_model.update([(0.8, 4096, 0.95)] * 8 + [(0.8, 8192, 0.93)] * 8)
    model.recall_model.update([(0.8, 32768, 0.82)] * 8 + [(0.8, 16384, 0.83)] * 8)
    learned = tune_budgets(units, model, cfg, "mass")
    assert learned.budgets[0] > prior.budgets[0] and learned.anchor_s > prior.anchor_s
    assert learned.predicted_recall >= learned.predicted_recall_static - 1e-9
    assert learned.predicted_recall_static > prior.predicted_recall_static


def test_trainer_feeds_the_recall_model_from_gathered_measurements():
    """What every rank does after a step: measured (recall sum, tokens) per micro-batch
    → (budget, longest document, sensitive-token recall) → recall_model.update."""
    from sb_titan.balance.measurements import StepMeasurements
    from sb_titan.balance.sab import MicroBatchPlan, Piece, StepPlan

    def mb(*lens):
        return MicroBatchPlan(rows=[[Piece(i, 0, n) for i, n in enumerate(lens)]])

    plan = StepPlan(step=0, epoch=0, microbatches=[[mb(4096)], [mb(100, 60, 2000)]])
    gathered = [
        {
            "dp": 0,
            "pp": 0,
            "seconds": {0: 2.0},
            "step_seconds": 2.1,
            "stats": {0: [0.8 * 4, 4.0, 0.85 * 4096 * 4, 4096.0 * 4, 0.5 * 512, 400.0, 512.0]},
        },
        {
            "dp": 1,
            "pp": 0,
            "seconds": {0: 1.0},
            "step_seconds": 2.1,
            "stats": {0: [0.9 * 4, 4.0, 0.95 * 2160 * 4, 2160.0 * 4, 0.9 * 256, 250.0, 256.0]},
        },
    ]  # STATS_FIELDS over 4 sparse layers: estimated, then sampled true recall

    m = StepMeasurements.from_gathered(gathered, plan, [[0.6], [1.0]])
    obs = m.recall_observations(plan, 64)
    assert [(b, n) for b, n, _ in obs] == [(0.6, 4096), (1.0, 2000)]
    want = [sensitive_recall([4096], 0.85, 64)[1], sensitive_recall([100, 60, 2000], 0.95, 64)[1]]
    assert [x for _, _, x in obs] == pytest.approx(want, rel=1e-12)
    assert obs[0][2] == pytest.approx((0.85 * 4096 - 128) / (4096 - 128))
    assert m.metrics()["sparsity/recall"] == pytest.approx((0.85 * 4096 + 0.95 * 2160) / 6256)
    # true recall: the sampled queries' mean, inverted the same way, and below beta
    true = m.recall_observations(plan, 64, measure="true")
    assert [x for _, _, x in true] == pytest.approx(
        [sensitive_recall([4096], 0.5, 64)[1], sensitive_recall([100, 60, 2000], 0.9, 64)[1]]
    )
    assert true[0][2] < 0.6 < obs[0][2]  # the estimator overstated what it kept
    hits = m.recall_observations(plan, 64, measure="top_key")
    assert [x for _, _, x in hits] == pytest.approx(
        [
            sensitive_recall([4096], 400 / 512, 64)[1],
            sensitive_recall([100, 60, 2000], 250 / 256, 64)[1],
        ]
    )
    assert m.metrics()["sparsity/true_recall"] == pytest.approx((0.5 * 512 + 0.9 * 256) / 768)
    assert m.metrics()["sparsity/top_key_hit"] == pytest.approx(650 / 768)


def test_an_unknown_selection_policy_is_refused(model):
    with pytest.raises(ValueError, match="policy must be one of"):
        tune_budgets(SKEWED, model, DSTConfig(), "dense")
