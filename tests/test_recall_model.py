"""RecallModel: the uniform-mass prior, learning a correction at any budget."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sb_titan.attention.selection import select_blocks
from sb_titan.balance.cost_model.recall import RecallModel
from sb_titan.balance.dst import sensitive_recall


def brute_uniform_kept(beta, length, block_size=64):
    """Kept share of uniform mass, averaged over the query blocks past the first two."""
    n_blocks = math.ceil(length / block_size)
    kept = [max(math.ceil(beta * n - 1e-9), 2) / n for n in range(3, n_blocks + 1)]
    return min(1.0, sum(kept) / len(kept))


@pytest.mark.parametrize("length", [256, 1024, 4096, 65536])
def test_prior_is_uniform_mass_and_at_least_beta(length):
    m = RecallModel()
    for beta in (0.25, 0.5, 0.8, 0.95):  # grid points of the tabulated prior
        assert float(m.predict(beta, length)) == pytest.approx(
            brute_uniform_kept(beta, length), abs=1e-9
        )
    beta = np.linspace(0.01, 1.0, 100)
    kept = m.predict(beta, length)
    assert (kept >= beta).all() and (np.diff(kept) >= -1e-12).all() and kept[-1] == 1.0
    # Short documents keep more beyond beta than long ones.
    assert m.predict(0.5, 512) > m.predict(0.5, 4096) > m.predict(0.5, 65536)


def test_a_correction_learned_at_one_budget_moves_every_budget():
    m = RecallModel()
    prior = lambda b, n: float(RecallModel().predict(b, n))  # noqa: E731
    m.update([(0.5, 4096, prior(0.5, 4096) + 0.05)] * 3 + [(0.6, 4096, prior(0.6, 4096) + 0.03)])
    assert float(m.predict(0.8, 4096)) == pytest.approx(prior(0.8, 4096) + 0.045)
    assert float(m.predict(1.0, 4096)) == 1.0
    # Unobserved lengths take the nearest observed knot's correction.
    assert float(m.predict(0.5, 65536)) == pytest.approx(prior(0.5, 65536) + 0.045)
    # Full budgets carry no information; "kept < beta" (measurement noise) clips to beta.
    m.update([(1.0, 4096, 1.0), (0.7, 512, 0.6)])
    assert m.count.sum() == 5
    assert float(m.predict(0.7, 512)) == pytest.approx(0.7)


def test_ema_after_max_count_and_state_round_trip():
    m = RecallModel(max_count=4)
    base = float(m.predict(0.5, 512))
    m.update([(0.5, 512, base + 0.1)] * 4)
    m.update([(0.5, 512, base + 0.2)] * 4)  # a full window of new evidence replaces the old
    assert float(m.predict(0.5, 512)) == pytest.approx(base + 0.2)
    fresh = RecallModel()
    fresh.load_state_dict(m.state_dict())
    assert fresh.max_count == 4 and np.array_equal(fresh.correction, m.correction)
    with pytest.raises(ValueError, match="shape"):
        fresh.load_state_dict({**m.state_dict(), "count": [0, 1]})


@pytest.mark.parametrize("policy", ["mass", "topk"])
def test_measured_selection_fits_the_model_across_budgets(policy):
    """What selection keeps, learned at one budget, predicts the others (within 0.05)."""
    g = torch.Generator().manual_seed(0)
    L = 2048
    q, k = torch.randn(1, 4, L, 32, generator=g), torch.randn(1, 2, L, 32, generator=g)
    q[..., :4] += 2.0
    doc_id = torch.zeros(1, L, dtype=torch.int32)

    def kept(beta):
        stats = select_blocks(q, k, doc_id, beta, policy=policy, block_size=64)[1]
        return sensitive_recall([L], float(stats.recall), 64)[1]

    m = RecallModel()
    m.update([(0.5, L, kept(0.5))])
    for beta in (0.3, 0.7, 0.9):
        assert abs(float(m.predict(beta, L)) - kept(beta)) < 0.05, (beta, kept(beta))


def test_true_recall_model_learns_a_gap_below_beta():
    """True kept mass can fall below beta (the estimator misjudged blocks): the `true`
    model learns it; the `estimated` model, whose measure never falls below beta, clips."""
    obs = [(0.8, 4096, 0.55)] * 20
    true, est = RecallModel(measure="true"), RecallModel(measure="estimated")
    true.update(obs)
    est.update(obs)
    assert float(true.predict(0.8, 4096)) == pytest.approx(0.55, abs=1e-9)
    assert float(est.predict(0.8, 4096)) >= 0.8
    assert float(true.predict(0.9, 4096)) > float(true.predict(0.8, 4096))  # still monotone
    state = true.state_dict()
    again = RecallModel(measure="true")
    again.load_state_dict(state)
    assert float(again.predict(0.8, 4096)) == float(true.predict(0.8, 4096))
    fresh = RecallModel(measure="estimated")
    fresh.load_state_dict(state)  # another quantity's corrections are not adopted
    assert float(fresh.predict(0.8, 4096)) == float(RecallModel().predict(0.8, 4096))


def _by_budget_pair():
    """A by-budget model and a per-length one fed the same measured curve: at 4096
    tokens recall rises from 0.76 at beta 0.5 to 0.94 at 0.9 (slope 0.45, not 1)."""
    curve = {0.5: 0.76, 0.7: 0.84, 0.9: 0.94}
    obs = [(b, 4096, r) for b, r in curve.items()] * 2
    by_budget, by_length = RecallModel(measure="true", beta_knots=20), RecallModel(measure="true")
    by_budget.update(obs)
    by_length.update(obs)
    return curve, by_budget, by_length


def test_by_budget_follows_a_measured_curve_the_per_length_correction_cannot():
    curve, by_budget, by_length = _by_budget_pair()
    for beta, kept in curve.items():
        assert float(by_budget.predict(beta, 4096)) == pytest.approx(kept, abs=1e-9)
    # between observed budgets: linear in the budget, prior included
    prior = RecallModel(measure="true")
    mid = np.mean([kept - float(prior.predict(b, 4096)) for b, kept in curve.items() if b != 0.5])
    assert float(by_budget.predict(0.8, 4096)) == pytest.approx(
        float(prior.predict(0.8, 4096)) + mid, abs=1e-9
    )
    # unobserved budgets take the nearest observed one's correction
    low = curve[0.5] - float(prior.predict(0.5, 4096))
    assert float(by_budget.predict(0.3, 4096)) == pytest.approx(
        float(prior.predict(0.3, 4096)) + low, abs=1e-9
    )
    # one constant per length misses the slope at both ends
    assert abs(float(by_length.predict(0.5, 4096)) - curve[0.5]) > 0.05
    assert abs(float(by_length.predict(0.9, 4096)) - curve[0.9]) > 0.05


def test_by_budget_observed_at_one_budget_predicts_as_the_per_length_model():
    by_budget, by_length = RecallModel(beta_knots=20), RecallModel()
    obs = [(0.9, n, 0.93) for n in (512, 4096, 65536)]
    by_budget.update(obs)
    by_length.update(obs)
    lengths = np.array([100.0, 700, 4096, 20000, 300000])
    for beta in (0.2, 0.5, 0.9, 1.0):
        assert (by_budget.predict(beta, lengths) == by_length.predict(beta, lengths)).all()


def test_by_budget_state_round_trip_and_a_per_length_state():
    _, by_budget, by_length = _by_budget_pair()
    fresh = RecallModel(measure="true", beta_knots=20)
    fresh.load_state_dict(by_budget.state_dict())
    lengths = np.array([512.0, 4096, 65536])
    for beta in (0.3, 0.6, 0.85):
        assert (fresh.predict(beta, lengths) == by_budget.predict(beta, lengths)).all()
    # a checkpoint of the per-length model: its corrections, learnt by budget afresh;
    # its state is what it was before budgets existed (the snapshots' digests hash it)
    keys = {"block_size", "log2_len_min", "log2_len_max", "max_count", "measure", "count", "mean"}
    assert set(by_length.state_dict()) == keys
    fresh.load_state_dict(by_length.state_dict())
    for beta in (0.3, 0.6, 0.85):
        assert (fresh.predict(beta, lengths) == by_length.predict(beta, lengths)).all()
