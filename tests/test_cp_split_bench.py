"""bench/context_parallel.py's logic: packed rows, the synthetic q/k's sparsity, the
per-block profile predictor, and the quick run's imbalance figures against plain loops.
No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
import torch
from conftest import REPO

from sb_titan.attention.layout import doc_ids_from_lengths
from sb_titan.attention.selection import select_blocks
from sb_titan.context_parallel.split import allowed_blocks

_spec = importlib.util.spec_from_file_location("cp_bench", REPO / "bench" / "context_parallel.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["cp_bench"] = bench  # dataclasses look their module up while it loads
_spec.loader.exec_module(bench)


def test_rows_are_packed_documents_and_padding():
    rows = bench.pack_rows(8192, 3, seed=0)
    doc_id = doc_ids_from_lengths(rows, 8192)
    for b, lens in enumerate(rows):
        assert 0 < sum(lens) <= 8192 and min(lens) >= 1
        ids, counts = torch.unique_consecutive(doc_id[b], return_counts=True)
        pad = 8192 - sum(lens)
        assert counts.tolist() == list(lens) + [1] * pad  # every pad token alone
    assert bool((doc_id[:, 1:] >= doc_id[:, :-1]).all())


def test_synthetic_qk_is_sparse_and_keeps_its_hot_blocks():
    rows = bench.pack_rows(16384, 1, seed=3)
    doc_id = doc_ids_from_lengths(rows, 16384)
    allowed = allowed_blocks(doc_id, 64)[0]
    _, q, k = next(bench.synthetic_qk(doc_id, seed=0))
    table, stats = select_blocks(q, k, doc_id, 0.9, policy="mass", block_size=64)
    assert float(stats.density[0]) < 0.5  # real sparsity, unlike random q/k (~beta)
    hot = k[0, :, ::64, 0] > 0.5  # [Hkv, NB]: the hot key blocks of each head
    count, ids = table.padded_kv()
    kept_hot = seen_hot = 0
    for h in range(k.shape[1]):
        for i in range(0, len(allowed), 7):
            lo = i - int(allowed[i]) + 1
            want = set((torch.nonzero(hot[h, lo : i + 1])[:, 0] + lo).tolist())
            got = set(ids[0, h, i, : count[0, h, i]].tolist())
            kept_hot += len(want & got)
            seen_hot += len(want)
    assert kept_hot >= 0.8 * seen_hot  # the mass is where the construction put it


def test_block_profile_learns_a_linear_profile():
    prof = bench.BlockProfile()
    n = np.arange(1, 3000, dtype=np.float64)
    prof.update(0.9, n, 3.0 + 0.1 * n)
    for x in (1.0, 5.0, 100.0, 1500.0, 2999.0, 6000.0):  # 6000: beyond the data
        assert prof.predict(0.9, np.array([x]))[0] == pytest.approx(min(3 + 0.1 * x, x), rel=1e-6)
    assert prof.predict(0.5, np.array([100.0]))[0] == pytest.approx(13.0)  # nearest budget
    with pytest.raises(ValueError, match="nothing observed"):
        bench.BlockProfile().predict(0.9, n)


def _zigzag_loads_by_loop(cost: np.ndarray, degree: int) -> list[float]:
    chunk = len(cost) // (2 * degree)
    return [
        float(cost[r * chunk : (r + 1) * chunk].sum())
        + float(cost[(2 * degree - 1 - r) * chunk : (2 * degree - r) * chunk].sum())
        for r in range(degree)
    ]


def test_quick_run_reports_both_splits(tmp_path):
    out = tmp_path / "cp.json"
    assert bench.main(["--quick", "--sources", "synthetic", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    rows = rep["rows_doc_lens"]
    setup = rep["setup"]
    doc_id = doc_ids_from_lengths(rows, setup["row_len"])
    allowed = allowed_blocks(doc_id, 64).astype(np.float64)
    results = rep["results"]
    assert {r["source"] for r in results} == {"synthetic", "dense"}
    assert {r["degree"] for r in results} == set(setup["degrees"])
    for r in results:
        assert r["predicted_split"] <= r["predicted_zigzag"] + 1e-12
        assert r["predicted_split"] <= 1.05 and r["predicted_lpt"] <= 1.05
        assert r["computed_split"] < r["computed_zigzag"]
        if r["source"] == "dense":  # computed = allowed pairs, by loops over zigzag chunks
            want = max(
                max(loads) / np.mean(loads)
                for loads in (_zigzag_loads_by_loop(a, r["degree"]) for a in allowed)
            )
            assert r["computed_zigzag"] == pytest.approx(want)
            assert r["density"] == pytest.approx(1.0)
        else:
            assert 0 < r["density"] < r["budget"]


def test_doc_density_cost_by_hand():
    """Two documents of 3 and 2 blocks, one layer, 2 heads: rho_d = kept / (allowed x
    heads) per document, cost rho_d x n, at least 1."""
    allowed = np.array([[1.0, 2.0, 3.0, 1.0, 2.0]])
    first_doc = np.array([[0, 0, 0, 1, 1]])
    kept = np.array([[[2.0, 4.0, 6.0, 2.0, 2.0]]])  # doc 0 dense; doc 1: 4 of 6 pairs
    cost = bench.doc_density_cost(kept, allowed, first_doc, heads=2)
    np.testing.assert_allclose(cost, [[1.0, 2.0, 3.0, 1.0, 4 / 6 * 2]])
