"""A budget per query block ([B, NB]): each block keeps what selection at its own
document's beta keeps, and a per-block budget of equal entries is the row-wide one,
bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cost_model import make_profile
from test_sparse_attention import make_doc_id, make_qkv

from sb_titan.attention.layout import AttnMeta, block_budgets
from sb_titan.attention.selection import select_blocks
from sb_titan.attention.sparse import sparse_attention
from sb_titan.balance.cost_model import CostModel
from sb_titan.context_parallel.split import (
    allowed_blocks,
    block_pairs_at,
    imbalance,
    layer_block_costs,
    predicted_block_pairs,
    rank_loads,
)
from sb_titan.models.attention import SBAttention
from sb_titan.runtime.cp_split import CPSplitter

torch.set_num_threads(1)

BS = 64
# documents crossing block boundaries; row 1 ends in 102 padding tokens (one doc each)
ROWS = [[150, 230, 40, 92], [300, 20, 90] + [1] * 102]
DOC_BETAS = [[0.3, 0.85, 0.55, 1.0], [0.55, 0.3, 0.85]]
SCORERS = ["int4_max", "mean"]
POLICIES = ["topk", "mass"]


def _inputs(seed: int = 0):
    doc_id = make_doc_id(ROWS)
    q, k, v = make_qkv(2, 4, 2, doc_id.shape[1], 32, seed=seed)
    return doc_id, q, k, v


def test_block_budgets_take_the_first_tokens_document():
    doc_id = make_doc_id(ROWS)
    got = block_budgets(doc_id, DOC_BETAS, BS)
    assert got.shape == (2, 8) and got.dtype == torch.float32
    for b, lens in enumerate(ROWS):
        starts = np.cumsum([0, *lens])
        for i in range(8):
            d = int(np.searchsorted(starts, i * BS, side="right")) - 1  # doc of token i*BS
            want = DOC_BETAS[b][min(d, len(DOC_BETAS[b]) - 1)]  # padding: the row's last
            assert got[b, i] == torch.tensor(want, dtype=torch.float32), (b, i)
    # the shape is the block count, however many padding documents a row has
    padded = make_doc_id([[64] + [1] * 448, [512]])
    assert torch.equal(
        block_budgets(padded, [[0.5], [0.7]], BS), torch.tensor([[0.5] * 8, [0.7] * 8])
    )
    with pytest.raises(ValueError, match="document budgets for each of 2 rows"):
        block_budgets(doc_id, [[0.5]], BS)


@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("policy", POLICIES)
def test_equal_block_budgets_are_the_row_wide_budget_bitwise(policy, scorer):
    """Tables, statistics, outputs and gradients: per-block beta (from per-document
    betas that are all equal) against the row-wide [B] beta."""
    doc_id, q, k, v = _inputs()
    row = torch.tensor([0.55, 0.3])
    per_block = block_budgets(doc_id, [[0.55] * 4, [0.3] * 3], BS)
    assert per_block.shape == (2, 8)
    runs = []
    for budget in (row, per_block):
        table, stats = select_blocks(
            q, k, doc_id, budget, policy=policy, block_size=BS, scorer=scorer
        )
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, _ = sparse_attention(
            qg, kg, vg, doc_id, budget, policy=policy, block_size=BS, backend="torch",
            scorer=scorer,
        )  # fmt: skip
        out.backward(torch.ones_like(out))
        runs.append([*table[:4], *stats, out.detach(), qg.grad, kg.grad, vg.grad])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def _rows_of(table, b: int, h: int, i: int) -> list[int]:
    lo, hi = table.kv_ptr[b, h, i], table.kv_ptr[b, h, i + 1]
    return table.kv_index[lo:hi].tolist()


@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("policy", POLICIES)
def test_mixed_budgets_keep_what_each_blocks_own_budget_keeps(policy, scorer):
    """Reference: the rows at each distinct beta (a scalar budget), each query block's
    kept key blocks (and its attention output) taken from its own beta's run."""
    doc_id, q, k, v = _inputs(seed=1)
    per_block = block_budgets(doc_id, DOC_BETAS, BS)
    sel = dict(policy=policy, block_size=BS, scorer=scorer)
    table, stats = select_blocks(q, k, doc_id, per_block, **sel)
    out, _ = sparse_attention(q, k, v, doc_id, per_block, backend="torch", **sel)
    refs = {}
    for beta in per_block.unique().tolist():
        ref_table, _ = select_blocks(q, k, doc_id, beta, **sel)
        ref_out, _ = sparse_attention(q, k, v, doc_id, beta, backend="torch", **sel)
        refs[beta] = ref_table, ref_out
    assert len(refs) == 4
    B, H, nb = table.kv_count.shape
    for b in range(B):
        kept = allowed = 0
        starts = np.cumsum([0, *ROWS[b]])
        for i in range(nb):
            ref_table, ref_out = refs[float(per_block[b, i])]
            for h in range(H):
                assert _rows_of(table, b, h, i) == _rows_of(ref_table, b, h, i), (b, h, i)
                kept += len(_rows_of(ref_table, b, h, i))
            rows = slice(i * BS, (i + 1) * BS)
            torch.testing.assert_close(out[b, :, rows], ref_out[b, :, rows], rtol=1e-6, atol=1e-6)
            doc_start = starts[np.searchsorted(starts, i * BS, side="right") - 1]
            allowed += H * (i - doc_start // BS + 1)
        # the density statistic counts the same pairs: kept / allowed block pairs
        assert float(stats.density[b]) == pytest.approx(kept / allowed, rel=1e-6)
    # mixed budgets are not a row-wide one: the table differs from the first beta's run
    first, _ = refs[float(per_block[0, 0])]
    assert not torch.equal(table.kv_ptr, first.kv_ptr)


def _density_at(beta: float):
    """A made-up density model: sqrt(beta) at every length."""
    return lambda lengths: np.full(np.shape(lengths), beta**0.5)


def test_block_costs_price_each_block_at_its_own_budget():
    """CP split pricing: each query block's predicted pairs are the one-budget price at
    its own beta; a row-wide budget gives the one-budget prices exactly."""
    allowed = np.array([[1, 2, 3, 4, 1, 2, 1, 1], [1, 2, 3, 1, 2, 3, 4, 5]], dtype=np.float64)
    budget = np.array([[0.3] * 4 + [0.8] * 2 + [0.5] * 2, [0.8] * 3 + [0.3] * 5])
    density_at = _density_at
    got = block_pairs_at(allowed, budget, density_at, BS)
    for beta in (0.3, 0.5, 0.8):
        want = predicted_block_pairs(allowed, density_at(beta), BS)
        assert np.array_equal(got[budget == beta], want[budget == beta])
    row = np.full_like(budget, 0.5)
    same = predicted_block_pairs(allowed, density_at(0.5), BS)
    assert np.array_equal(block_pairs_at(allowed, row, density_at, BS), same)
    costs = layer_block_costs(allowed, budget, density_at, BS, sparse_layers=3, dense_layers=1)
    assert np.array_equal(costs, allowed + 3 * got)
    with pytest.raises(ValueError, match="per query block"):
        block_pairs_at(allowed, budget[:, :4], density_at, BS)


@pytest.mark.parametrize("policy", POLICIES)
def test_cp_split_prices_each_block_at_its_documents_budget(policy):
    """The trainer's CP split with documents at different betas: its predicted
    imbalance is that of the blocks priced at their own document's beta by the cost
    model (reference: the row priced at each beta, each block from its own)."""
    model = CostModel(make_profile(block_size=BS))
    model.density_model.update([(0.3, 1024, 0.15), (0.9, 2048, 0.7)] * 3)
    lens = [[1500, 300, 2000, 296], [4096]]
    doc_id = make_doc_id(lens)
    betas = [[0.3, 0.9, 0.6, 0.9], [0.45]]
    split, predicted = CPSplitter(4, BS, policy, False, 3, 1)(model, doc_id, betas)
    allowed = allowed_blocks(doc_id, BS)
    per_block = block_budgets(doc_id, betas, BS, torch.float64).numpy()
    sparse = np.zeros_like(allowed, dtype=np.float64)
    for beta in {b for row in betas for b in row}:
        price = predicted_block_pairs(allowed, lambda n, b=beta: model.densities(b, n, policy), BS)
        sparse = np.where(per_block == beta, price, sparse)
    cost = allowed + 3 * sparse
    want = float(np.mean([imbalance(row) for row in rank_loads(cost, split)]))
    assert predicted == want
    row_wide = CPSplitter(4, BS, policy, False, 3, 1)(model, doc_id, [[0.3], [0.45]])[1]
    assert predicted != row_wide  # the documents' own budgets moved the pricing


def test_compiled_attention_takes_new_budgets_and_layouts_without_recompiling():
    """[B, NB] whatever the documents: a compiled layer runs a new layout with mixed
    budgets on the graph a row-wide budget compiled, and matches eager on it."""
    doc_id, q, k, v = _inputs()
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, L, H, D]
    torch.compiler.reset()  # no graphs of other shapes from earlier tests in this process
    layer = SBAttention(SBAttention.Config(policy="topk", block_size=BS, scorer="mean"))
    compiled = torch.compile(layer, fullgraph=True)
    row_wide = AttnMeta(doc_id, block_budgets(doc_id, [[0.5]] * 2, BS))
    compiled(q, k, v, attention_masks=row_wide, enable_gqa=True)
    other = make_doc_id([[512], [64] * 8])
    mixed = AttnMeta(other, block_budgets(other, [[0.4], [0.2, 1.0, 0.6] * 3], BS))
    with torch.compiler.set_stance("fail_on_recompile"):
        out = compiled(q, k, v, attention_masks=mixed, enable_gqa=True)
    eager = layer(q, k, v, attention_masks=mixed, enable_gqa=True)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


def test_compiled_attention_takes_a_new_sequence_length():
    """A second length recompiles with dynamic shapes (dynamo's automatic dynamic, as in
    evaluation at another length): the selection op's pair count then has a symbolic
    bound, and the dynamic graph still matches eager at both lengths."""
    torch.compiler.reset()
    layer = SBAttention(SBAttention.Config(policy="topk", block_size=BS, scorer="mean"))
    compiled = torch.compile(layer, fullgraph=True)
    for rows in (ROWS, [[256, 128], [200, 184]], [[100, 220, 64], [384]]):
        doc_id = make_doc_id(rows)
        q, k, v = make_qkv(2, 4, 2, doc_id.shape[1], 32, seed=len(rows[0]))
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        meta = AttnMeta(doc_id, block_budgets(doc_id, [[0.5]] * 2, BS))
        out = compiled(q, k, v, attention_masks=meta, enable_gqa=True)
        eager = layer(q, k, v, attention_masks=meta, enable_gqa=True)
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
