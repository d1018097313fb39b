"""Per-document recall history ([dst] doc_history): each query block's sampled sums are
credited to its document, each document's own recall is inverted to its sensitive
tokens' kept mass, the planner carries it to the sample's next plan, and per-document
DST gives budget first to the documents that lost more than the model predicts.

References are hand computations and loops written token by token, never the code's
own output."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sb_titan.attention.layout import doc_ids_from_lengths, document_sums
from sb_titan.balance.doc_dst import step_doc_budgets
from sb_titan.balance.dst import DSTConfig
from sb_titan.balance.measurements import StepMeasurements
from sb_titan.balance.sab import MicroBatchPlan, Piece, SABConfig, StepPlan
from sb_titan.balance.sab.planner import Planner
from sb_titan.simulator import Cluster, Scenario, build_simulator

BS = 64


def test_document_sums_credit_each_block_to_its_first_tokens_document():
    rows = [[100, 20, 200], [64, 300], [5]]  # a short document inside a block; padding
    L = 400
    doc_id = doc_ids_from_lengths(rows, L)
    values = torch.rand(3, len(rows), L // BS + 1, generator=torch.Generator().manual_seed(0))
    got = document_sums(values, doc_id, [len(r) for r in rows], BS)
    want = []
    for b, lens in enumerate(rows):
        sums = [[0.0] * 3 for _ in lens]
        for qb in range(values.shape[2]):
            first, start = qb * BS, 0
            for d, n in enumerate(lens):  # the document holding token `first`
                if start <= first < start + n:
                    sums[d] = [s + float(values[c, b, qb]) for c, s in enumerate(sums[d])]
                start += n
        want += sums
    assert got.shape == (6, 3)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    assert got[1].abs().sum() == 0  # tokens 100..119: no block starts in it
    with pytest.raises(ValueError, match="2 rows of documents, values have 3"):
        document_sums(values, doc_id, [3, 2], BS)


def _measured(doc_budgets=None) -> StepMeasurements:
    return StepMeasurements(
        seconds={},
        rank_compute={},
        step_seconds=1.0,
        density={(0, 0): 0.5},
        recall={},
        budgets=[[0.6]],
        # per document: true recall sum, top-key hits, pairs, kept and allowed blocks
        doc_sums={(0, 0): [(6.0, 9.0, 10.0, 20.0, 80.0), (1.0, 1.0, 1.0, 4.0, 4.0), (0,) * 5]},
        doc_budgets=doc_budgets,
        sample_rate=0.5,
    )


PLAN = StepPlan(
    step=3,
    epoch=0,
    microbatches=[
        [MicroBatchPlan(rows=[[Piece(7, 0, 640), Piece(9, 0, 100)], [Piece(4, 0, 900)]])]
    ],
)


@pytest.mark.parametrize("measure", ["true", "top_key"])
def test_document_recalls_invert_each_documents_own_recall(measure):
    ids, rows = _measured([[[0.7, 0.9, 0.8]]]).document_recalls(PLAN, BS, measure, 8.0)
    # sample 7: 640 tokens, 128 insensitive (its first two blocks), 512 sensitive;
    # recall 6/10 (true) or 9/10 (top-key) over its sampled pairs; kept = (r*640-128)/512;
    # 512 sensitive tokens = 8 blocks, sampled at 0.5: 4 blocks, weight 4 / (4 + 8).
    # Sample 9 (100 tokens) has no sensitive tokens; sample 4 was never sampled.
    r = 0.6 if measure == "true" else 0.9
    assert ids == [7]
    np.testing.assert_allclose(rows, [[0.7, (r * 640 - 128) / 512, 1 / 3]], rtol=1e-12)
    _, rows = _measured().document_recalls(PLAN, BS, measure, 8.0)
    assert rows[0, 0] == 0.6  # no per-document budgets: the micro-batch's


def test_sab_learns_each_documents_own_density_where_it_was_credited():
    """Kept over allowed key blocks of each document's own query blocks; a document with
    no block of its own keeps its micro-batch's density."""
    ids, densities = _measured().sample_densities(PLAN)
    assert ids == [7, 9, 4]
    assert densities == [20.0 / 80.0, 1.0, 0.5]
    without = dataclasses.replace(_measured(), doc_sums={})  # history off: as before
    assert without.sample_densities(PLAN) == ([7, 9, 4], [0.5, 0.5, 0.5])


def _planner() -> Planner:
    return Planner(
        [300, 200, 150, 100] * 4,
        seq_len=512,
        dp=1,
        microbatches=2,
        rows_per_microbatch=1,
        config=SABConfig(policy="sab", observe_lag=2, shuffle=False),
        cost_fn=lambda lens, dens: float(sum(lens)),
    )


def _recalls(plan: StepPlan) -> dict[int, list[float]]:
    out = {}
    for mb in plan.microbatches[0]:
        pieces = [p for row in mb.rows for p in row]
        for p, r in zip(pieces, mb.recalls or [[np.nan] * 3] * len(pieces), strict=True):
            if not np.isnan(r[0]):
                out[p.sample_id] = r
    return out


def test_planner_carries_a_samples_recall_from_observe_lag_on_and_checkpoints_it():
    a = _planner()
    first = a.next_step()
    assert first.microbatches[0][0].recalls is None  # nothing measured yet
    ids = sorted({p.sample_id for mb in first.microbatches[0] for row in mb.rows for p in row})
    rows = np.array([[0.5 + 0.01 * i, 0.25, 0.75] for i in range(len(ids))])
    a.observe_recalls(ids, rows, step=first.step)
    saved = a.state_dict()
    b = _planner()
    b.load_state_dict(saved)
    seen = []
    for planner in (a, b):  # a restored planner plans the same steps, with the same recalls
        steps = [planner.next_step() for _ in range(12)]
        assert _recalls(steps[0]) == {}  # step 1 < 0 + observe_lag
        seen.append([_recalls(s) for s in steps[1:]])
    assert seen[0] == seen[1]
    later = {k: v for s in seen[0] for k, v in s.items()}
    assert later and all(later[i] == pytest.approx(rows[ids.index(i)]) for i in later)
    old = {k: v for k, v in saved["observations"].items() if k != "recalls"}
    c = _planner()  # a checkpoint from before per-document recall: none observed
    c.load_state_dict({**saved, "observations": old})
    assert all(_recalls(c.next_step()) == {} for _ in range(12))
    with pytest.raises(ValueError, match="must lie in"):
        a.observe_recalls([0], np.array([[0.5, 1.5, 0.5]]), step=20)


def test_documents_that_lost_more_than_predicted_get_budget_first():
    """Two documents alike in every input but their history: the one that lost 1.3x the
    recall model's predicted mass at its last budget is given more budget than the one
    that lost 0.7x; without history they tie. With full weight, its curve passes
    through what it measured."""
    cluster = Cluster(dp=1, pp=1, microbatches=1, seq_len=8192)
    model = build_simulator(cluster, Scenario(flavor="0.5b", steps=2)).models.planning
    cfg = DSTConfig(anchor="mean", per_document=True, beta_min=0.3, long_tokens=8192)
    n, seen = 4096, 0.6
    pred = float(model.recall_model.predict(seen, np.array([float(n)]))[0])
    assert 0.05 < 1 - pred < 0.45  # room to lose 1.3x as much
    mb = MicroBatchPlan(rows=[[Piece(0, 0, n)], [Piece(1, 0, n)]])
    plan = StepPlan(step=0, epoch=0, microbatches=[[mb]])
    budgets = [[0.6]]
    off = step_doc_budgets(plan, budgets, None, model, cfg, "mass").budgets[0][0]
    assert off[0] == off[1]
    mb.recalls = [[seen, 1 - 1.3 * (1 - pred), 1.0], [seen, 1 - 0.7 * (1 - pred), 1.0]]
    on = step_doc_budgets(plan, budgets, None, model, cfg, "mass")
    assert on.budgets[0][0][0] > on.budgets[0][0][1]
    unused = dataclasses.replace(cfg, doc_history=False)
    assert step_doc_budgets(plan, budgets, None, model, unused, "mass").budgets[0][0] == off
    # the curve at the measured budget: its first two blocks, and the measured kept mass
    mb.recalls = [[0.6, 0.7, 1.0], [0.6, 0.7, 1.0]]
    single = step_doc_budgets(plan, [[0.6]], None, model, cfg, "mass")
    assert single.budgets[0][0] == [0.6, 0.6]  # the same curves: an equal split
    want = (2 * BS + (n - 2 * BS) * 0.7) / n
    assert single.predicted_recall == pytest.approx(want, rel=1e-12)
