"""The kernels' tile rules against the brute-force token mask, on every tile pair.

Forward/dQ and dK/dV cut sub-tiles they call dead from their iteration range and drop
the mask on pairs they call interior (kernels/attn_*.py; transcribed in
bench/kernel_balance.py's `_kernel_rules`). Both are only correct if no pair with an
allowed (query, key) token pair is cut and every unmasked pair is all-allowed. The
interpreter numerics (tests/test_kernels.py) check the end result on two rows; this
checks every tile pair of several layouts and tile shapes, including rows the numerics
never produce.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from conftest import REPO
from sb_titan_kernels.attn_common import doc_bounds

_spec = importlib.util.spec_from_file_location("bench_kb", REPO / "bench" / "kernel_balance.py")
kb = importlib.util.module_from_spec(_spec)
sys.modules["bench_kb"] = kb
_spec.loader.exec_module(kb)

LAYOUTS = [[300], [20, 5, 40, 64, 71], [1] * 10 + [290], [64, 64, 3, 125, 44], [130, 1, 1, 168]]


@pytest.mark.parametrize("lengths", LAYOUTS, ids=lambda x: f"{len(x)}docs")
@pytest.mark.parametrize("bm,bn", [(64, 64), (128, 32), (32, 64), (64, 32)])
def test_tile_rules_match_the_token_mask(lengths, bm, bn):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    L = doc.numel()
    start, end = (x[0].long() for x in doc_bounds(doc[None].int()))
    m0, n0 = torch.cartesian_prod(torch.arange(0, L, bm), torch.arange(0, L, bn)).unbind(1)
    dead, interior, _ = kb._pair_classes(doc, m0, n0, bm, bn)
    for kind in ("fwd", "dkdv"):
        run, masked = kb._kernel_rules(kind, start, end, m0, n0, bm, bn, L)
        assert not (~dead & ~run).any(), f"{kind}: a pair with allowed tokens is cut"
        assert not (~interior & ~masked & run).any(), f"{kind}: a partial pair runs unmasked"
        if kind == "dkdv":  # dK/dV sums over rows, so an unmasked pair needs all rows real
            assert not (~masked & run & (m0 + bm > L)).any()
        assert (dead & ~run).any()  # the range cut does cut
        if len(lengths) == 1:  # and one long document has unmasked interior pairs
            assert (interior & ~masked).any()


def test_doc_bounds_brute_force():
    doc = torch.tensor([[0, 0, 1, 2, 2, 2, 3], [5, 5, 5, 5, 5, 5, 5]], dtype=torch.int32)
    start, end = doc_bounds(doc)
    for b, row in enumerate(doc.tolist()):
        for t, d in enumerate(row):
            same = [i for i, x in enumerate(row) if x == d]
            assert start[b, t] == same[0] and end[b, t] == same[-1] + 1
