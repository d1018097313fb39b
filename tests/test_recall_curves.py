"""Held-out recall: bench/recall_curves.py's block-level true recall against a brute-force
fp64 softmax, and sb-simulate's held-out scoring (simulator/heldout.py) against curves
whose values are known. No timing is asserted."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from conftest import REPO

from sb_titan.attention.layout import doc_ids_from_lengths
from sb_titan.attention.recall import kept_block_mask, sample_positions
from sb_titan.attention.selection import select_blocks
from sb_titan.balance.dst import DSTConfig
from sb_titan.simulator import (
    Cluster,
    Scenario,
    build_simulator,
    draw_lengths,
    make_balancer,
    simulate,
)
from sb_titan.simulator.heldout import RecallCurves
from sb_titan.tools.simulate import main

sys.path.insert(0, str(REPO / "bench"))  # as the bench runs: its folder first on the path
try:
    import recall_curves as bench
finally:
    sys.path.remove(str(REPO / "bench"))


def test_block_true_recall_is_the_exact_kept_mass_of_each_sampled_query():
    """On the synthetic pattern (block-constant q/k), the block-level shortcut equals a
    token-by-token fp64 softmax of every sampled query over its allowed keys."""
    L, bs = 640, 64
    doc_id = doc_ids_from_lengths([[L]], L)
    pos = sample_positions(doc_id, bs, 1.0)[0]
    assert bool(((pos % bs) != bs - 1).any())  # queries inside blocks: partial diagonals
    checked = 0
    for _, q, k in bench.synthetic_qk(doc_id, seed=5):
        scale = q.shape[-1] ** -0.5
        table, _ = select_blocks(q, k, doc_id, 0.6, policy="mass", block_size=bs)
        kept = kept_block_mask(table.kv_ptr, table.kv_index)[0]
        assert not bool(kept.all())  # some blocks dropped, so the test can see them
        recall, hit = bench.block_true_recall(q[0], k[0], kept, pos, bs, scale)
        G = q.shape[1] // k.shape[1]
        for h in range(q.shape[1]):
            for i, p in enumerate(pos.tolist()):
                logits = (q[0, h, p].double() @ k[0, h // G, : p + 1].double().T) * scale
                probs = torch.softmax(logits, dim=0)
                in_kept = kept[h // G, i, torch.arange(p + 1) // bs]
                assert float(recall[h, i]) == pytest.approx(float(probs[in_kept].sum()), abs=1e-6)
                top = int(torch.argmax(logits)) // bs
                assert bool(hit[h, i]) == bool(kept[h // G, i, top])
                checked += 1
    assert checked == 4 * 4 * (L // bs)


def _curves_file(tmp_path, docs, betas=(0.5, 1.0)) -> str:
    path = tmp_path / "curves.json"
    path.write_text(json.dumps({"format": bench.FORMAT, "betas": list(betas), "documents": docs}))
    return str(path)


def _doc(length, half, true, top_key=None, estimated=None):
    return {
        "length": length,
        "half": half,
        "true": list(true),
        "top_key": list(top_key if top_key is not None else true),
        "estimated": list(estimated if estimated is not None else true),
        "density": list(true),
    }


def test_score_interpolates_budget_and_log_length_and_weights_tokens(tmp_path):
    docs = [
        _doc(1024, "heldout", (0.4, 1.0)),
        _doc(1024, "heldout", (0.6, 1.0)),  # mean with the one above: 0.5 at beta 0.5
        _doc(4096, "heldout", (0.7, 0.9), top_key=(0.2, 0.3)),
        _doc(1024, "fit", (1.0, 1.0)),
    ]
    curves = RecallCurves.load(_curves_file(tmp_path, docs))
    # beta 0.75 halfway: 1024 -> 0.75, 4096 -> 0.8; 2048 is halfway in log2 length
    assert curves.score([1024], [0.75])["true"] == pytest.approx(0.75)
    assert curves.score([2048], [0.5])["true"] == pytest.approx(0.6)
    assert curves.score([2048], [0.5])["top_key"] == pytest.approx((0.5 + 0.2) / 2)
    assert curves.score([100_000], [0.5])["true"] == pytest.approx(0.7)  # clamped
    assert curves.score([300], [1.0])["true"] == pytest.approx(1.0)
    # token-weighted, and a one-token document does not attend
    got = curves.score([1024, 4096, 1], [0.5, 0.5, 0.5])["true"]
    assert got == pytest.approx((1024 * 0.5 + 4096 * 0.7) / 5120)


def test_the_recall_model_learns_the_fit_half_only(tmp_path):
    """Fit documents keep everything, held-out ones half: the model DST plans with
    predicts the fit half, and the score is the held-out half's."""
    docs = [_doc(n, "fit", (1.0, 1.0)) for n in (1024, 8192)]
    docs += [_doc(n, "heldout", (0.5, 0.5)) for n in (1024, 8192)]
    curves = RecallCurves.load(_curves_file(tmp_path, docs))
    out_of_range = DSTConfig(recall_measure="true", beta_min=0.9, beta0=0.9, beta_max=0.95)
    prior = curves.fitted_model(out_of_range, 64)  # no fit budget in range: the prior
    model = curves.fitted_model(DSTConfig(recall_measure="true"), 64)
    assert prior.count.sum() == 0 and model.count.sum() > 0
    for n in (1024, 8192):
        assert float(prior.predict(0.5, [n])[0]) < 0.6
        assert float(model.predict(0.5, [n])[0]) == pytest.approx(1.0)
    assert curves.score([1024, 8192], [0.5, 0.9])["true"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("mangle", "needle"),
    [
        (lambda r: r.update(format="other"), "not a recall-curves file"),
        (lambda r: r.update(betas=[0.5]), "'betas'"),
        (lambda r: r["documents"][0].update(true=[0.5, 1.5]), "document 0"),
        (lambda r: r["documents"].insert(0, [512]), "document 0"),
        (lambda r: r["documents"][1].update(half="fit"), "both halves"),
    ],
)
def test_bad_curves_are_refused_in_one_line(tmp_path, mangle, needle):
    rep = {
        "format": bench.FORMAT,
        "betas": [0.5, 1.0],
        "documents": [_doc(512, "fit", (0.5, 1.0)), _doc(512, "heldout", (0.5, 1.0))],
    }
    mangle(rep)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(rep))
    with pytest.raises(ValueError) as err:
        RecallCurves.load(path)
    assert needle in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_simulated_steps_are_scored_at_the_budgets_they_trained_with(tmp_path):
    """With held-out recall equal to the budget at every length, a step's held-out recall
    is its token-weighted mean budget: beta0 for the baseline, and for per-document DST
    every document at its own budget, not its micro-batch's."""
    docs = [_doc(n, half, (0.5, 1.0)) for n in (128, 65536) for half in ("fit", "heldout")]
    cluster = Cluster(dp=2, pp=2, microbatches=4, seq_len=16384)
    sc = Scenario(flavor="0.5b", steps=1, recall_curves=_curves_file(tmp_path, docs))
    sc.dst = DSTConfig(anchor="recall", per_document=True, recall_measure="true")
    rep, _ = simulate(cluster, sc)
    assert rep["variants"]["baseline"]["heldout_true"] == pytest.approx(sc.dst.beta0)
    assert rep["setup"]["recall_measure"] == "true"

    sim = build_simulator(cluster, sc)
    lengths = draw_lengths(cluster, sc.steps, sc.seed)
    variant = "sab_dst_doc"
    balancer = make_balancer(
        lengths, cluster, sc.sab, "sab", sim.models.planning, sim.dst_config(variant)
    )
    scheduled = balancer.next_step()
    got = sim.run_step(scheduled, variant).heldout["true"]
    units = [mb for rank in scheduled.plan.microbatches for mb in rank]
    lens = np.array([n for mb in units for n in mb.doc_lens], dtype=np.float64)
    own = np.array([b for rank in scheduled.doc_budgets.budgets for mb in rank for b in mb])
    shared = np.repeat(np.ravel(scheduled.budgets), [len(mb.doc_lens) for mb in units])
    w = np.where(lens >= 2, lens, 0.0)
    assert got == pytest.approx(float((w * own).sum() / w.sum()))
    assert got != pytest.approx(float((w * shared).sum() / w.sum()))


def test_cli_reports_held_out_recall_and_refuses_a_bad_file(tmp_path, capsys):
    docs = [_doc(n, half, (0.5, 1.0)) for n in (128, 65536) for half in ("fit", "heldout")]
    out = tmp_path / "sim.json"
    argv = ["--flavor", "0.5b", "--dp", "2", "--microbatches", "2", "--seq-len", "4096"]
    argv += ["--steps", "1", "--quiet", "--json", str(out)]
    assert main([*argv, "--recall-curves", _curves_file(tmp_path, docs)]) == 0
    assert "held true" in capsys.readouterr().out
    for r in json.loads(out.read_text())["variants"].values():
        assert {"heldout_true", "heldout_top_key"} <= set(r)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main([*argv, "--recall-curves", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(bad) in err and "\n" not in err


def test_the_quick_bench_writes_curves_the_simulator_reads(tmp_path, keep_torch_threads):
    """bench/recall_curves.py --quick: both halves, every measure in [0, 1], everything
    kept at budget 1, and more kept mass at a larger budget."""
    out = tmp_path / "curves.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    curves = RecallCurves.load(out)
    assert curves.lengths.tolist() == list(bench.QUICK_LENGTHS)
    assert len(curves.fit) == len(bench.QUICK_LENGTHS) * bench.QUICK_DOCS // 2
    true = curves.heldout["true"]
    assert np.allclose(true[:, -1], 1.0) and (np.diff(true, axis=1) >= -1e-9).all()
    assert true[-1, 0] < 0.95  # 2048 tokens at beta 0.3 lose mass: selection dropped blocks
