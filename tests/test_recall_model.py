"""RecallModel: prior, learning the overshoot from any budget, length interpolation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sb_titan.attention.selection import select_blocks
from sb_titan.dst import sensitive_recall
from sb_titan.recall_model import RecallModel


def test_prior_is_the_lower_bound_beta():
    m = RecallModel()
    beta = np.linspace(0.05, 1.0, 20)
    assert np.allclose(m.predict(beta, 4096), beta)


def test_overshoot_learned_at_one_budget_predicts_the_others():
    m = RecallModel()
    m.update([(0.5, 1024, 0.62)] * 3 + [(0.6, 1024, 0.70)])  # overshoots 0.12 x3, 0.10
    assert m.predict(0.8, 1024) == pytest.approx(0.8 + 0.115)
    assert m.predict(0.95, 1024) == 1.0 and m.predict(1.0, 1024) == 1.0
    # Unobserved lengths take the nearest observed knot; between knots, interpolation.
    assert m.predict(0.5, 65536) == pytest.approx(0.615)
    m.update([(0.5, 4096, 0.52)])
    # 2**11.5: halfway between knot 11 (unobserved: ties go to the lower, 10) and 12.
    assert m.predict(0.5, 2**11.5) == pytest.approx(0.5 + (0.115 + 0.02) / 2)
    # Full budgets carry no information; an impossible "kept < beta" clips to 0.
    m.update([(1.0, 4096, 1.0), (0.7, 4096, 0.6)])
    assert m.count[12 - 6] == 2  # knot log2(4096) = 12
    assert m.predict(0.5, 4096) == pytest.approx(0.51)


def test_ema_after_max_count_and_state_round_trip():
    m = RecallModel(max_count=4)
    m.update([(0.5, 512, 0.6)] * 4)
    m.update([(0.5, 512, 0.9)] * 4)  # a full window of new evidence replaces the old
    assert m.predict(0.5, 512) == pytest.approx(0.9)
    fresh = RecallModel()
    fresh.load_state_dict(m.state_dict())
    assert fresh.max_count == 4 and np.array_equal(fresh.delta, m.delta)
    with pytest.raises(ValueError, match="shape"):
        fresh.load_state_dict({**m.state_dict(), "count": [0, 1]})


@pytest.mark.parametrize("policy", ["mass", "topk"])
def test_measured_selection_fits_the_model_across_budgets(policy):
    """The premise: for a document, kept - beta is about constant in beta, so an
    overshoot learned at one budget predicts the kept mass at another (here within
    0.06, where predicting the lower bound beta would be off by the overshoot itself)."""
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
        assert abs(float(m.predict(beta, L)) - kept(beta)) < 0.06, (beta, kept(beta))
