"""Dynamic block-sparse attention (PyTorch path): estimator, selection, table, kernel.

The attention is checked against an independent fp64 reference: an explicit
softmax(QK^T)V whose per-query key mask is the block table expanded to tokens AND the
token-level causal/document mask, built here from scratch.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sb_titan.attention.block_sparse import block_sparse_forward
from sb_titan.attention.estimator import estimate_block_mass
from sb_titan.attention.layout import document_causal_mask
from sb_titan.attention.ops import block_sparse_attention
from sb_titan.attention.selection import BlockTable, select_blocks, transpose_table
from sb_titan.attention.sparse import sparse_attention

torch.set_num_threads(1)


def make_doc_id(rows: list[list[int]]) -> torch.Tensor:
    """[B, L] int32 from per-row document lengths (each row must sum to the same L)."""
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    ).to(torch.int32)


def make_qkv(B, Hq, Hkv, L, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, L, D, generator=g, dtype=dtype)
    # Give a few key blocks a large mean so the estimated mass is far from uniform.
    k[:, :, : L // 3] += 0.5 * torch.randn(B, Hkv, 1, D, generator=g, dtype=dtype)
    return q, k, v


def block_mask(table: BlockTable, nb: int) -> torch.Tensor:
    """[B, Hkv, NB, NB] bool from the kv part of the table."""
    count, index = table.padded_kv()
    B, H = count.shape[:2]
    mask = torch.zeros(B, H, nb, nb + 1, dtype=torch.bool)
    slot = torch.arange(index.shape[-1])
    mask.scatter_(-1, torch.where(slot < count[..., None], index.long(), nb), True)
    return mask[..., :nb]


def block_mask_from_transpose(table: BlockTable, nb: int) -> torch.Tensor:
    """[B, Hkv, NB(query), NB(key)] bool from the q part of the table."""
    count, index = table.padded_q()
    B, H = count.shape[:2]
    mask = torch.zeros(B, H, nb, nb + 1, dtype=torch.bool)  # [key, query]
    slot = torch.arange(index.shape[-1])
    mask.scatter_(-1, torch.where(slot < count[..., None], index.long(), nb), True)
    return mask[..., :nb].transpose(-1, -2)


def reference_attention(q, k, v, doc_id, table, scale=None):
    """fp64 softmax(QK^T)V with the table expanded to tokens AND the causal/doc mask."""
    B, Hq, L, D = q.shape
    G = Hq // k.shape[1]
    bs = table.block_size
    nb = -(-L // bs)
    blocks = block_mask(table, nb).repeat_interleave(bs, 2).repeat_interleave(bs, 3)
    allowed = blocks[:, :, :L, :L].repeat_interleave(G, dim=1)
    pos = torch.arange(L)
    causal = pos[None, :] <= pos[:, None]
    same_doc = doc_id[:, :, None] == doc_id[:, None, :]
    allowed = allowed & (causal & same_doc)[:, None]
    q, k, v = (x.double() for x in (q, k, v))
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scale = D**-0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def grads(fn, q, k, v, grad_out):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return out.detach(), dq, dk, dv


def assert_all_close(got, ref, tol: float) -> None:
    """out, dq, dk, dv of `got` against `ref` (compared in ref's dtype)."""
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(
            a.to(b.dtype), b, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}"
        )


# Rows with several documents, a document shorter than a block, doc starts inside blocks
# and L = 650 (not a multiple of 64 or 128).
DOCS_650 = [[40, 300, 200, 110], [650]]
DOCS_650B = [[64, 20, 500, 66], [130, 129, 391]]

CASES = [
    # policy, budget per row, Hq, Hkv, D, block_size, docs
    ("mass", [0.3, 0.7], 7, 1, 64, 64, DOCS_650),
    ("mass", [1.0, 0.1], 2, 2, 128, 64, DOCS_650B),
    ("topk", [0.1, 0.3], 7, 1, 64, 64, DOCS_650B),
    ("topk", [0.7, 1.0], 2, 2, 64, 128, DOCS_650),
    ("topk", [0.3, 0.3], 4, 2, 128, 128, DOCS_650B),
]


@pytest.mark.parametrize("policy,budget,Hq,Hkv,D,bs,docs", CASES)
def test_matches_independent_reference(policy, budget, Hq, Hkv, D, bs, docs):
    doc_id = make_doc_id(docs)
    B, L = doc_id.shape
    q, k, v = make_qkv(B, Hq, Hkv, L, D)
    table, _ = select_blocks(q, k, doc_id, torch.tensor(budget), policy=policy, block_size=bs)
    grad_out = torch.randn(B, Hq, L, D, generator=torch.Generator().manual_seed(1))
    q64, k64, v64 = (x.double() for x in (q, k, v))
    ref = grads(
        lambda q, k, v: reference_attention(q, k, v, doc_id, table), q64, k64, v64, grad_out
    )
    got = grads(lambda q, k, v: block_sparse_attention(q, k, v, doc_id, table), q, k, v, grad_out)
    assert got[0].dtype == torch.float32 and ref[0].dtype == torch.float64
    assert_all_close(got, ref, 1e-5)
    got64 = grads(
        lambda q, k, v: block_sparse_attention(q, k, v, doc_id, table), q64, k64, v64, grad_out
    )
    assert_all_close(got64, ref, 1e-10)


@pytest.mark.parametrize("policy,budget", [("topk", 1.0), ("mass", 0.5)])
def test_rows_split_into_slices_match_reference(monkeypatch, policy, budget):
    """Rows longer than the chunk limit are cut along their kept list (online softmax in
    the forward, accumulated dQ/dK/dV); two blocks per slice here."""
    from sb_titan.attention import block_sparse

    monkeypatch.setattr(block_sparse, "_chunk_pairs", lambda per_pair, device: (2, 2))
    doc_id = make_doc_id([[40, 300, 200, 110], [100, 10, 30, 510]])
    q, k, v = make_qkv(2, 4, 2, 650, 64, torch.float64)
    table, _ = select_blocks(q, k, doc_id, budget, policy=policy, block_size=64)
    assert int(table.kv_count.max()) > 2 and int(table.q_count.max()) > 2
    grad_out = torch.randn(2, 4, 650, 64, dtype=torch.float64)
    ref = grads(lambda q, k, v: reference_attention(q, k, v, doc_id, table), q, k, v, grad_out)
    got = grads(lambda q, k, v: block_sparse_attention(q, k, v, doc_id, table), q, k, v, grad_out)
    assert_all_close(got, ref, 1e-10)


def test_worker_threads_match_reference_and_are_deterministic():
    """With T > 1 torch threads, chunks run on T single-threaded workers: same results
    as the reference, bit-identical on repeat, and torch's thread setting untouched."""
    from sb_titan.attention import workers

    doc_id = make_doc_id(DOCS_650B)
    q, k, v = make_qkv(2, 7, 1, 650, 64, torch.float64)
    table, _ = select_blocks(q, k, doc_id, 0.5, policy="mass", block_size=64)
    grad_out = torch.randn(2, 7, 650, 64, dtype=torch.float64)
    ref = grads(lambda q, k, v: reference_attention(q, k, v, doc_id, table), q, k, v, grad_out)
    try:
        torch.set_num_threads(2)
        runs = [
            grads(lambda q, k, v: block_sparse_attention(q, k, v, doc_id, table), *x)
            for x in [(q, k, v, grad_out)] * 2
        ]
        # Grad mode is per thread: workers must follow the caller's no_grad (L = 640 so
        # that the workers read q itself, not a padded copy).
        doc640 = make_doc_id([[300, 340]])
        q6, k6, v6 = make_qkv(1, 7, 1, 640, 64, torch.float64)
        t640, _ = select_blocks(q6, k6, doc640, 0.5, policy="mass", block_size=64)
        with torch.no_grad():
            out, _ = block_sparse_forward(q6.requires_grad_(), k6, v6, doc640, t640, 0.125)
        per_worker = list(workers._pool(2).map(lambda _: torch.get_num_threads(), range(4)))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert per_worker == [1, 1, 1, 1]
    assert_all_close(runs[0], ref, 1e-10)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    want = reference_attention(q6.detach(), k6, v6, doc640, t640)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)


def test_lse_is_logsumexp_of_kept_scores():
    doc_id = make_doc_id(DOCS_650)
    q, k, v = make_qkv(2, 2, 1, 650, 64, torch.float64)
    table, _ = select_blocks(q, k, doc_id, 0.4, policy="mass", block_size=64)
    _, lse = block_sparse_forward(q, k, v, doc_id, table, 0.125)
    blocks = block_mask(table, 11).repeat_interleave(64, 2).repeat_interleave(64, 3)
    pos = torch.arange(650)
    keep = blocks[:, :, :650, :650] & (pos[None, :] <= pos[:, None])
    keep = keep & (doc_id[:, :, None] == doc_id[:, None, :])[:, None]
    scores = (q @ k.transpose(-1, -2) * 0.125).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_topk_full_budget_equals_dense(dtype, tol):
    doc_id = make_doc_id(DOCS_650B)
    q, k, v = make_qkv(2, 7, 1, 650, 64, dtype)
    grad_out = torch.randn(2, 7, 650, 64, dtype=dtype)
    table, stats = select_blocks(q, k, doc_id, 1.0, policy="topk", block_size=64)
    assert torch.equal(stats.density, torch.ones(2))
    torch.testing.assert_close(stats.recall, torch.ones(2))
    mask = document_causal_mask(doc_id)  # the explicit [B, 1, L, L] dense reference

    def masked_sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    dense = grads(masked_sdpa, q, k, v, grad_out)
    got = grads(lambda q, k, v: block_sparse_attention(q, k, v, doc_id, table), q, k, v, grad_out)
    assert_all_close(got, dense, tol)


# ---- estimator and selection against brute force -------------------------------------


def brute_force_selection(q, k, doc_id, budget, policy, bs):
    """Python loops straight from the contract: (kept sets, prob, density, recall)."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G, nb = Hq // Hkv, -(-L // bs)
    blocks = [range(i * bs, min((i + 1) * bs, L)) for i in range(nb)]
    doc = doc_id.tolist()
    kept, probs = {}, {}
    density, recall = [], []
    for b in range(B):
        n_kept = n_allowed_total = 0
        masses = []
        first = [doc[b][blk[0]] for blk in blocks]
        last = [doc[b][blk[-1]] for blk in blocks]
        start_block = [doc[b].index(first[i]) // bs for i in range(nb)]
        # recall averages over tokens of documents with >= 2 tokens (not padding)
        attending = [sum(doc[b].count(doc[b][t]) > 1 for t in blk) for blk in blocks]
        for h in range(Hkv):
            kp = [k[b, h, list(blk)].double().mean(0) for blk in blocks]
            for i in range(nb):
                qp = q[b, h * G : (h + 1) * G][:, list(blocks[i])].double().mean((0, 1))
                allowed = [j for j in range(nb) if j == i or (j < i and last[j] == first[i])]
                score = torch.stack([qp @ kp[j] for j in allowed]) * D**-0.5
                prob = dict(zip(allowed, torch.softmax(score, 0).tolist(), strict=True))
                forced = {i, start_block[i]}
                order = sorted(allowed, key=lambda j: (j not in forced, -prob[j], j))
                beta = float(budget[b])
                if policy == "topk":
                    count = max(math.ceil(beta * len(allowed) * (1 - 1e-6)), len(forced))
                else:
                    count, mass = 0, 0.0
                    while count < len(order) and (count < len(forced) or mass < beta - 1e-6):
                        mass += prob[order[count]]
                        count += 1
                kept[b, h, i] = sorted(order[:count])
                probs[b, h, i] = prob
                masses.append(attending[i] * sum(prob[j] for j in kept[b, h, i]))
                n_kept += count
                n_allowed_total += len(allowed)
        density.append(n_kept / n_allowed_total)
        recall.append(sum(masses) / (Hkv * sum(attending)) if sum(attending) else 1.0)
    return kept, probs, torch.tensor(density), torch.tensor(recall)


@pytest.mark.parametrize("policy", ["mass", "topk"])
def test_selection_and_stats_match_brute_force(policy):
    doc_id = make_doc_id([[100, 30, 200, 190, 1, 1, 118], [600] + [1] * 40])  # 1s: padding
    q, k, _ = make_qkv(2, 4, 2, 640, 32, seed=3)
    budget = torch.tensor([0.5, 0.25])
    table, stats = select_blocks(q, k, doc_id, budget, policy=policy, block_size=64)
    kept, probs, density, recall = brute_force_selection(q, k, doc_id, budget, policy, 64)
    for (b, h, i), ids in kept.items():
        lo, hi = table.kv_ptr[b, h, i : i + 2].tolist()
        assert table.kv_index[lo:hi].tolist() == ids, (b, h, i)
    torch.testing.assert_close(stats.density, density.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(stats.recall, recall.float(), atol=1e-5, rtol=0)
    prob, allowed = estimate_block_mass(q, k, doc_id, block_size=64)
    for (b, h, i), p in probs.items():
        assert allowed[b, h, i].nonzero().flatten().tolist() == sorted(p)
        want = torch.tensor([p[j] for j in sorted(p)], dtype=torch.float64)
        torch.testing.assert_close(prob[b, h, i, sorted(p)].double(), want, atol=1e-6, rtol=0)


def test_estimator_range_and_chunking_are_consistent():
    doc_id = make_doc_id([[700, 324], [1, 1023]])
    q, k, _ = make_qkv(2, 4, 2, 1024, 64)
    prob, allowed = estimate_block_mass(q, k, doc_id, block_size=64)
    part, part_allowed = estimate_block_mass(q, k, doc_id, block_size=64, q_block_range=(5, 9))
    torch.testing.assert_close(part, prob[:, :, 5:9])
    assert torch.equal(part_allowed, allowed[:, :, 5:9])
    torch.testing.assert_close(prob.sum(-1), torch.ones(2, 2, 16))
    assert (prob[~allowed] == 0).all()
    for policy in ("mass", "topk"):
        whole = select_blocks(q, k, doc_id, 0.4, policy=policy, block_size=64)
        chunked = select_blocks(q, k, doc_id, 0.4, policy=policy, block_size=64, chunk_blocks=3)
        for a, b in zip(whole[0][:4] + whole[1], chunked[0][:4] + chunked[1], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["mass", "topk"])
@pytest.mark.parametrize("budget", [0.1, 0.3, 0.7, 1.0])
def test_table_invariants(policy, budget):
    doc_id = make_doc_id(DOCS_650B)
    q, k, _ = make_qkv(2, 6, 2, 650, 64, seed=int(budget * 10))
    table, stats = select_blocks(q, k, doc_id, budget, policy=policy, block_size=64)
    nb = 11
    B, H = 2, 2
    assert table.block_size == 64
    assert table.kv_ptr.dtype == table.q_ptr.dtype == torch.int64
    assert table.kv_index.dtype == table.q_index.dtype == torch.int32
    assert table.kv_ptr.shape == table.q_ptr.shape == (B, H, nb + 1)
    # CSR: one flat array per side, exactly the kept pairs, rows contiguous and ascending
    kept = int(table.kv_count.sum())
    assert table.kv_index.shape == table.q_index.shape == (kept,)
    for ptr, index in ((table.kv_ptr, table.kv_index), (table.q_ptr, table.q_index)):
        bounds = ptr.flatten().tolist()
        assert bounds[0] == 0 and bounds[-1] == kept
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            assert lo <= hi and index[lo:hi].tolist() == sorted(set(index[lo:hi].tolist()))
    mask = block_mask(table, nb)
    assert torch.equal(mask, block_mask_from_transpose(table, nb))
    assert torch.equal(table.q_count, mask.sum(-2).int())
    # Sink (start block of the query block's first document) and diagonal are always kept.
    for b in range(B):
        for i in range(nb):
            first_doc = doc_id[b, i * 64]
            sink = int((doc_id[b] == first_doc).nonzero()[0]) // 64
            assert mask[b, :, i, i].all() and mask[b, :, i, sink].all()
    # topk realises max(ceil(beta * n_allowed), n_forced) blocks; mass reaches its target.
    prob, allowed = estimate_block_mass(q, k, doc_id, block_size=64)
    assert (mask <= allowed).all()
    n_allowed = allowed.sum(-1)
    kept_mass = (prob * mask).sum(-1)
    if policy == "topk":
        n_forced = 1 + (n_allowed > 1).long()
        want = torch.ceil(budget * n_allowed * (1 - 1e-6)).long().clamp(min=n_forced)
        assert torch.equal(table.kv_count.long(), want)
        assert budget < 1.0 or torch.equal(mask, allowed)
    else:
        assert (kept_mass >= budget - 1e-5).all()
    tokens = torch.tensor([[64.0] * 10 + [10.0]] * 2)  # 650 tokens, no one-token documents
    want = (kept_mass.mean(1) * tokens).sum(-1) / tokens.sum(-1)
    torch.testing.assert_close(stats.recall, want)
    assert torch.equal(stats.tokens, tokens.sum(-1))


def test_mass_is_minimal():
    """Dropping the last added (lowest-mass, non-forced) block would miss the target."""
    doc_id = make_doc_id([[1024]])
    q, k, _ = make_qkv(1, 2, 1, 1024, 64, seed=7)
    beta = 0.6
    table, _ = select_blocks(q, k, doc_id, beta, policy="mass", block_size=64)
    prob, _ = estimate_block_mass(q, k, doc_id, block_size=64)
    for i in range(16):
        lo, hi = table.kv_ptr[0, 0, i : i + 2].tolist()
        ids = table.kv_index[lo:hi].long()
        p = prob[0, 0, i, ids]
        forced = (ids == i) | (ids == 0)
        if (~forced).any():
            assert p.sum() - p[~forced].min() < beta - 1e-6


def test_per_row_budgets_and_densities():
    doc_id = make_doc_id([[1024], [1024]])
    q, k, _ = make_qkv(2, 2, 1, 1024, 64)
    table, stats = select_blocks(
        q, k, doc_id, torch.tensor([0.25, 1.0]), policy="topk", block_size=64
    )
    assert stats.density[1] == 1.0
    n = torch.arange(1, 17)  # one document: query block i may see i + 1 blocks
    want = torch.maximum(torch.ceil(0.25 * n), (n > 1) + 1.0)
    assert torch.equal(table.kv_count[0, 0], want.int())
    assert float(stats.density[0]) == pytest.approx(float(want.sum() / n.sum()))
    assert (table.kv_count[0] <= table.kv_count[1]).all()


def random_table(B, H, nb, density, seed=0) -> BlockTable:
    """Any lower-triangular pattern with the diagonal: pairs before a document's start
    are allowed in a table and must simply contribute nothing."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, H, nb, nb, generator=g) < density
    keep |= torch.eye(nb, dtype=torch.bool)
    keep &= torch.ones(nb, nb, dtype=torch.bool).tril()
    ends = keep.sum(-1).flatten().cumsum(0).view(B, H, nb)
    kv_ptr = torch.cat([torch.zeros(B, H, 1, dtype=torch.int64), ends], -1)
    previous_end = torch.cat([torch.zeros(1, dtype=torch.int64), ends.flatten(0, 1)[:-1, -1]])
    kv_ptr[..., 0] = previous_end.view(B, H)
    kv_index = keep.nonzero()[:, 3].int()  # row-major: (b, h, i) rows, ascending j
    return BlockTable(kv_ptr, kv_index, *transpose_table(kv_ptr, kv_index), 64)


def test_transpose_table_roundtrip():
    table = random_table(2, 3, 9, 0.4)
    assert torch.equal(block_mask_from_transpose(table, 9), block_mask(table, 9))


def test_arbitrary_table_matches_reference():
    doc_id = make_doc_id([[40, 300, 200, 110], [100, 10, 30, 510]])
    q, k, v = make_qkv(2, 4, 2, 650, 64, torch.float64)
    table = random_table(2, 2, 11, 0.5, seed=1)
    grad_out = torch.randn(2, 4, 650, 64, dtype=torch.float64)
    ref = grads(lambda q, k, v: reference_attention(q, k, v, doc_id, table), q, k, v, grad_out)
    got = grads(lambda q, k, v: block_sparse_attention(q, k, v, doc_id, table), q, k, v, grad_out)
    assert_all_close(got, ref, 1e-10)


# ---- public entry point and argument checks ------------------------------------------


def test_sparse_attention_entry_point():
    doc_id = make_doc_id(DOCS_650)
    # The model hands over [B, L, H, D].transpose(1, 2): non-contiguous views.
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in make_qkv(2, 7, 1, 650, 64))
    q.requires_grad_()
    budget = torch.tensor([0.5, 0.9])
    out, stats = sparse_attention(q, k, v, doc_id, budget, backend="torch")
    table, ref_stats = select_blocks(q, k, doc_id, budget, policy="mass", block_size=64)
    assert stats.density.dtype == stats.recall.dtype == torch.float32
    assert torch.equal(stats.density, ref_stats.density)
    assert torch.equal(stats.recall, ref_stats.recall)
    assert torch.equal(out, block_sparse_attention(q, k, v, doc_id, table))
    assert torch.equal(out, block_sparse_attention(q.contiguous(), k, v, doc_id, table))
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    auto, _ = sparse_attention(q, k, v, doc_id, 0.5, policy="topk", block_size=128)
    assert auto.shape == q.shape


def test_bad_arguments_raise_clear_errors():
    doc_id = make_doc_id([[128]])
    q, k, v = make_qkv(1, 4, 2, 128, 32)
    sel = dict(policy="mass", block_size=64)
    with pytest.raises(ValueError, match="unknown policy 'dense'.*mass.*topk"):
        select_blocks(q, k, doc_id, 0.5, policy="dense", block_size=64)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"budget must lie in \(0, 1\]"):
            select_blocks(q, k, doc_id, bad, **sel)
    with pytest.raises(ValueError, match="budget must be a scalar or"):
        select_blocks(q, k, doc_id, torch.ones(3), **sel)
    with pytest.raises(ValueError, match="block_size must be one of"):
        select_blocks(q, k, doc_id, 0.5, policy="mass", block_size=32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        select_blocks(q[:, :3], k, doc_id, 0.5, **sel)
    with pytest.raises(ValueError, match="does not match q"):
        select_blocks(q, k[:, :, :100], doc_id, 0.5, **sel)
    with pytest.raises(ValueError, match="doc_id must be"):
        select_blocks(q, k, doc_id[:, :100], 0.5, **sel)
    with pytest.raises(ValueError, match="non-decreasing"):
        select_blocks(
            q, k, doc_id.flip(1) + torch.arange(128, dtype=torch.int32).flip(0), 0.5, **sel
        )
    with pytest.raises(ValueError, match="q_block_range"):
        estimate_block_mass(q, k, doc_id, block_size=64, q_block_range=(1, 5))
    with pytest.raises(ValueError, match="unknown backend"):
        sparse_attention(q, k, v, doc_id, 0.5, backend="cuda")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            sparse_attention(q, k, v, doc_id, 0.5, backend="triton")
    table, _ = select_blocks(q, k, doc_id, 1.0, **sel)
    no_diag = table._replace(kv_index=torch.zeros_like(table.kv_index))
    with pytest.raises(ValueError, match="end with the diagonal"):
        block_sparse_attention(q, k, v, doc_id, no_diag)
    bad_transpose = table._replace(q_index=table.q_index.flip(0))
    with pytest.raises(ValueError, match="not the transpose"):
        block_sparse_attention(q, k, v, doc_id, bad_transpose)
    bad_ptr = table._replace(q_ptr=table.q_ptr + 1)
    with pytest.raises(ValueError, match="not a CSR offset array"):
        block_sparse_attention(q, k, v, doc_id, bad_ptr)
    with pytest.raises(ValueError, match="table.kv_ptr must be"):
        block_sparse_attention(q, k[:, :1], v[:, :1], doc_id, table)
