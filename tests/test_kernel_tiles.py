"""The kernels' tile classes against the brute-force token mask (no Triton needed).

Forward/dQ and dK/dV skip sub-tiles they call dead and drop the mask on tiles they call
interior (kernels/block_sparse_attn.py). Both are only correct if a dead tile has no
allowed (query, key) pair and an interior tile has no masked one; the interpreter
numerics (tests/test_kernels.py) check the end result, this checks every tile pair of
many layouts, including the ones small test rows never produce.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys

import pytest
import torch
from conftest import REPO
from sb_titan_kernels.block_sparse_attn import doc_bounds

_spec = importlib.util.spec_from_file_location(
    "bench_mask_skipping", REPO / "bench" / "mask_skipping.py"
)
mask_skipping = importlib.util.module_from_spec(_spec)
sys.modules["bench_mask_skipping"] = mask_skipping  # NamedTuple looks its module up
_spec.loader.exec_module(mask_skipping)

LAYOUTS = [[300], [20, 5, 40, 64, 71], [1] * 10 + [290], [64, 64, 3, 125, 44], [130, 1, 1, 168]]


def _allowed(doc: torch.Tensor, rows: range, cols: range) -> torch.Tensor:
    r, c = torch.tensor(list(rows)), torch.tensor(list(cols))
    return (c[None] <= r[:, None]) & (doc[c][None] == doc[r][:, None])


def _dkdv_class(start_m, start_n, bm, bn, seq_len, end) -> str:
    """dK/dV's rules (key tile fixed, query sub-tiles walked), as the kernel states them."""
    last_key = min(start_n + bn, seq_len) - 1
    if start_m + bm <= start_n or start_m >= end[last_key]:
        return "dead"
    if start_n + bn <= start_m + 1 and start_m + bm <= end[start_n]:
        return "interior"
    return "masked"


@pytest.mark.parametrize("lengths", LAYOUTS, ids=lambda x: f"{len(x)}docs")
@pytest.mark.parametrize("bm,bn", [(64, 64), (128, 32), (32, 64), (16, 64)])
def test_tile_classes_match_the_token_mask(lengths, bm, bn):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    L = doc.numel()
    start, end = (x[0].tolist() for x in doc_bounds(doc[None].int()))
    seen = {"dead": 0, "interior": 0, "masked": 0}
    for start_m, start_n in itertools.product(range(0, L, bm), range(0, L, bn)):
        rows = range(start_m, min(start_m + bm, L))
        cols = range(start_n, min(start_n + bn, L))
        allowed = _allowed(doc, rows, cols)
        fwd = mask_skipping.classify(start_m, start_n, bm, bn, L, start)
        bwd = _dkdv_class(start_m, start_n, bm, bn, L, end)
        for kernel, kind in (("fwd", fwd), ("dkdv", bwd)):
            seen[kind] += 1
            if kind == "dead":
                assert not allowed.any(), (kernel, start_m, start_n)
            if kind == "interior":
                # every key real and every real pair allowed; dK/dV also sums over the
                # rows, so they must all be real (forward/dQ do not store rows >= L)
                rows_real = len(rows) == bm or kernel == "fwd"
                ok = rows_real and len(cols) == bn and allowed.all()
                assert ok, (kernel, start_m, start_n)
    assert seen["dead"] and seen["masked"]


def test_doc_bounds_brute_force():
    doc = torch.tensor([[0, 0, 1, 2, 2, 2, 3], [5, 5, 5, 5, 5, 5, 5]], dtype=torch.int32)
    start, end = doc_bounds(doc)
    for b, row in enumerate(doc.tolist()):
        for t, d in enumerate(row):
            same = [i for i, x in enumerate(row) if x == d]
            assert start[b, t] == same[0] and end[b, t] == same[-1] + 1


def test_model_counts_interior_tiles_on_long_documents():
    """The bench's model on a real selection: long documents are mostly interior tiles,
    short ones mostly masked, and skipping never adds tiles."""
    rows = {r["mean_doc"]: r for r in mask_skipping.run(2048, 128, [1.0])[:1]}
    rows |= {r["mean_doc"]: r for r in mask_skipping.run(2048, 1024, [1.0])[:1]}
    assert rows[1024]["interior_share"] > 0.5 > rows[128]["interior_share"]
    for r in rows.values():
        assert r["tiles_after"] <= r["tiles_before"]
        assert r["useful_over_computed_after"] >= r["useful_over_computed_before"]
