"""True recall and top-key hits against an independent fp64 computation, and the
estimator families against naive references written token by token.

The reference here builds the whole token x token document-causal softmax in fp64 and
reads the kept blocks off the table as a token mask: nothing of recall.py (chunked
online log-sum-exp, the forward's lse, searchsorted membership) is reused."""

from __future__ import annotations

import math

import pytest
import torch

from sb_titan.attention.block_scores import ORACLES, SCORERS, quantize_int4
from sb_titan.attention.estimator import estimate_block_mass, sink_blocks
from sb_titan.attention.layout import doc_ids_from_lengths, document_causal_mask
from sb_titan.attention.ops import attention_forward, measure_true_recall, select
from sb_titan.attention.recall import sample_positions
from sb_titan.attention.selection import select_blocks
from sb_titan.attention.sparse import sparse_attention

ROWS = [[300, 17, 250, 133], [64, 64, 450, 122]]  # docs shorter than / across blocks
L = 700


def _inputs(hq=4, hkv=2, d=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, L, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv))
    return q, k, v, doc_ids_from_lengths(ROWS, L)


def _kept_token_mask(table, hq: int) -> torch.Tensor:
    """[B, Hq, L, L] bool: key u is in a block the table keeps for query t's block."""
    count, ids = table.padded_kv()
    B, hkv, nb = count.shape
    bs = table.block_size
    keep = torch.zeros(B, hkv, nb, nb, dtype=torch.bool)
    for b in range(B):
        for h in range(hkv):
            for i in range(nb):
                keep[b, h, i, ids[b, h, i, : count[b, h, i]].long()] = True
    keep = keep.repeat_interleave(hq // hkv, 1)
    return keep.repeat_interleave(bs, 2).repeat_interleave(bs, 3)[:, :, :L, :L]


@pytest.mark.parametrize("scorer,policy,budget", [("mean", "mass", 0.5), ("int4_max", "topk", 0.3)])
def test_true_recall_equals_fp64_kept_mass(scorer, policy, budget):
    q, k, v, doc_id = _inputs()
    scale = q.shape[-1] ** -0.5
    table, _ = select(
        q, k, doc_id, budget, policy=policy, block_size=64, scale=scale, scorer=scorer
    )
    _, lse = attention_forward(q, k, v, doc_id, table, scale, "torch")
    got = measure_true_recall(q, k, doc_id, lse, table, scale=scale, rate=1.0, lse_base2=False)
    # independent: full fp64 softmax, kept mass and arg-max key per sampled query
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    logits = torch.einsum("bhtd,bhud->bhtu", q, kk) * scale
    logits = logits.masked_fill(~document_causal_mask(doc_id), float("-inf"))
    p = torch.softmax(logits, dim=-1)
    kept = _kept_token_mask(table, q.shape[1])
    mass = (p * kept).sum(-1)  # [B, Hq, L]
    hit = kept.gather(-1, p.argmax(-1, keepdim=True))[..., 0]
    pos = sample_positions(doc_id, 64, 1.0)
    want_recall, want_hits, want_n = (torch.zeros(pos.shape, dtype=torch.float64) for _ in "rhn")
    for b, qb in (pos >= 0).nonzero().tolist():  # per query block, at its sampled query
        want_recall[b, qb] = mass[b, :, pos[b, qb]].sum()
        want_hits[b, qb] = hit[b, :, pos[b, qb]].sum().double()
        want_n[b, qb] = q.shape[1]
    torch.testing.assert_close(got[0], want_recall, rtol=1e-10, atol=1e-10)
    assert got[1].tolist() == want_hits.tolist()
    assert got[2].tolist() == want_n.tolist() and (want_n.sum(1) > 0).all()
    assert 0 < got[0].sum() < got[2].sum()  # blocks were really dropped


def test_sampling_is_positional_attending_and_deterministic():
    doc_id = doc_ids_from_lengths([[1, 1, 1, 200, 97], [300]], 300)  # 3 one-token docs
    pos = sample_positions(doc_id, 64, 1.0)
    assert torch.equal(pos, sample_positions(doc_id.clone(), 64, 1.0))  # no RNG
    assert (pos[0, 0] < 0 or pos[0, 0] >= 3) and (pos >= 0).sum() >= 8
    valid = pos[pos >= 0]
    assert bool(((valid // 64) == torch.nonzero(pos >= 0)[:, 1]).all())  # its own block
    assert (pos[:, -1] < 300).all()  # within the partial last block
    half = sample_positions(doc_id, 64, 0.5)
    assert 0 < (half >= 0).sum() < (pos >= 0).sum()  # a rate samples fewer blocks
    assert bool(((half == pos) | (half < 0)).all())  # ... at the same offsets


def test_triton_lse_base2_converts():
    """The kernels' log-sum-exp is base 2: the same recall from lse / ln 2 with the flag."""
    q, k, v, doc_id = _inputs()
    scale = q.shape[-1] ** -0.5
    table, _ = select(q, k, doc_id, 0.5, policy="mass", block_size=64, scale=scale)
    _, lse = attention_forward(q, k, v, doc_id, table, scale, "torch")
    nat = measure_true_recall(q, k, doc_id, lse, table, scale=scale, rate=1.0, lse_base2=False)
    two = measure_true_recall(
        q, k, doc_id, lse / math.log(2.0), table, scale=scale, rate=1.0, lse_base2=True
    )
    torch.testing.assert_close(two[0], nat[0], rtol=1e-12, atol=1e-12)


def _spike_inputs(bs: int = 64, d: int = 32):
    """One document of 8 blocks. The last query block asks for one key (token 100 of
    block 1): that key alone matches the queries strongly, while every other token of
    block 1 points away from them, so block 1's mean is small. Blocks 2..6 are diffuse
    and mildly aligned with the queries on average."""
    g = torch.Generator().manual_seed(3)
    Lr = 8 * bs
    q = torch.randn(1, 1, Lr, d, generator=g, dtype=torch.float64) * 0.1
    k = torch.randn(1, 1, Lr, d, generator=g, dtype=torch.float64) * 0.1
    e = torch.zeros(d, dtype=torch.float64)
    e[0] = 1.0
    q[0, 0, 7 * bs :] += 3.0 * e  # the asking block
    k[0, 0, bs : 2 * bs] -= 0.6 * e  # block 1 points away ...
    k[0, 0, 100] = 7.0 * e  # ... except its one needle key
    k[0, 0, 2 * bs : 7 * bs] += 0.35 * e  # diffuse, mildly aligned blocks
    v = torch.randn(1, 1, Lr, d, generator=g, dtype=torch.float64)
    return q, k, v, torch.zeros(1, Lr, dtype=torch.int64)


def test_single_spike_block_mean_misses_it_int4_max_keeps_it():
    q, k, v, doc_id = _spike_inputs()
    mean_table, mean_stats = select_blocks(q, k, doc_id, 0.5, policy="topk", block_size=64)
    int4_table, _ = select_blocks(
        q, k, doc_id, 0.5, policy="topk", block_size=64, scorer="int4_max"
    )

    def keeps(table, i: int, j: int) -> bool:
        count, ids = table.padded_kv()
        return j in ids[0, 0, i, : count[0, 0, i]].tolist()

    assert not keeps(mean_table, 7, 1) and keeps(int4_table, 7, 1)
    out, stats = sparse_attention(q, k, v, doc_id, 0.5, policy="topk", true_recall_rate=1.0)
    true_mean = float(stats.true_recall.sum() / stats.samples.sum())
    assert true_mean < float(mean_stats.recall[0])  # mean's estimate overstates what it kept
    _, s4 = sparse_attention(
        q, k, v, doc_id, 0.5, policy="topk", true_recall_rate=1.0, scorer="int4_max"
    )
    assert float(s4.top_hit.sum()) > float(stats.top_hit.sum())  # the needle's block kept


# ---------------------------------------------------------------- scorers vs naive loops
def _naive_block_scores(q, k, doc_id, scorer: str, bs: int) -> torch.Tensor:
    """[B, Hkv, NB, NB] block scores, one block pair at a time (-inf where not allowed)."""
    B, Hq, Lr, D = q.shape
    hkv = k.shape[1]
    G = Hq // hkv
    nb = -(-Lr // bs)
    scale = D**-0.5
    allowed_tok = document_causal_mask(doc_id)[:, 0]  # [B, L, L]
    if scorer == "int4_max":
        kc = k - k.mean(dim=2, keepdim=True)
        (qq, qs), (kq, ks) = quantize_int4(q), quantize_int4(kc)
        tok = torch.einsum("bhtd,bhud->bhtu", qq * qs, (kq * ks).repeat_interleave(G, 1))
    elif scorer in ("kmax", "pool8_max"):
        tok = None
    else:  # exact / exact_max: the true softmax
        tok = torch.einsum("bhtd,bhud->bhtu", q, k.repeat_interleave(G, 1)) * scale
        tok = torch.softmax(tok.masked_fill(~allowed_tok[:, None], float("-inf")), -1)
    out = torch.full((B, hkv, nb, nb), float("-inf"), dtype=torch.float64)
    sink = sink_blocks(doc_id, bs)
    start = [[int(doc_id[b].tolist().index(d)) for d in doc_id[b].tolist()] for b in range(B)]
    for b in range(B):
        for h in range(hkv):
            heads = slice(h * G, (h + 1) * G)
            for i in range(nb):
                for j in range(int(sink[b, i]), i + 1):
                    t, u = (
                        slice(i * bs, min((i + 1) * bs, Lr)),
                        slice(j * bs, min((j + 1) * bs, Lr)),
                    )
                    if scorer == "kmax":  # block-mean query vs each key the block's first sees
                        qm = q[b, heads, t].mean(dim=(0, 1))
                        keys = [
                            x for x in range(u.start, u.stop) if start[b][t.start] <= x < t.stop
                        ]
                        out[b, h, i, j] = max(float(qm @ k[b, h, x]) for x in keys) * scale
                        continue
                    if scorer == "pool8_max":
                        out[b, h, i, j] = _naive_pool8(q[b, heads], k[b, h], start[b], t, u) * scale
                        continue
                    ok = allowed_tok[b, t, u]
                    x = tok[b, heads, t, u].double()
                    if scorer == "exact":
                        out[b, h, i, j] = x.sum() / (G * x.shape[1])
                    elif ok.any():
                        out[b, h, i, j] = x[:, ok].max() * (scale if scorer == "int4_max" else 1)
    return out


def _naive_pool8(qh, kh, start: list[int], t: slice, u: slice) -> float:
    """Max over 8-token sub-block pairs (a, b) of block pair (t, u), b <= a and b no
    earlier than the first sub-block of a's first token's document, over the heads."""
    best = float("-inf")
    for a in range(t.start, t.stop, 8):
        qa = qh[:, a : a + 8].mean(dim=1)  # [G, D]
        for c in range(u.start, u.stop, 8):
            if c // 8 <= a // 8 and c // 8 >= start[a] // 8:
                best = max(best, float((qa @ kh[c : c + 8].mean(dim=0)).max()))
    return best


@pytest.mark.parametrize("scorer", ["int4_max", "kmax", "pool8_max", "exact", "exact_max"])
def test_scorer_matches_naive_reference(scorer):
    q, k, v, doc_id = _inputs(d=16)
    got = _probs(q, k, doc_id, scorer)
    raw = _naive_block_scores(q, k, doc_id, scorer, 64)
    allowed = torch.isfinite(raw)
    if scorer in ("int4_max", "kmax", "pool8_max"):  # a softmax of the block maxima
        want = torch.softmax(raw, dim=-1)
    else:  # the oracles' distribution: their block values, normalised
        want = torch.where(allowed, raw, 0.0)
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-6)


def _probs(q, k, doc_id, scorer: str) -> torch.Tensor:
    from sb_titan.attention.block_scores import score_chunks

    chunk = score_chunks(
        q,
        k,
        doc_id,
        sink_blocks(doc_id, 64),
        scorer=scorer,
        block_size=64,
        scale=q.shape[-1] ** -0.5,
    )
    nb = -(-q.shape[2] // 64)
    return torch.cat([chunk(s, min(s + 4, nb))[0] for s in range(0, nb, 4)], dim=2)


def test_every_scorer_is_a_distribution_over_allowed_blocks():
    q, k, _, doc_id = _inputs(d=16, dtype=torch.float32)
    _, allowed = estimate_block_mass(q, k, doc_id, block_size=64)
    for scorer in SCORERS[1:]:
        p = _probs(q, k, doc_id, scorer)
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)), rtol=0, atol=1e-5)
        assert (p[~allowed] == 0).all() and (p >= 0).all(), scorer


def test_oracles_are_refused_for_training():
    from sb_titan.models.attention import SparseAttentionConfig

    for oracle in ORACLES:
        with pytest.raises(ValueError, match=f"sparse_attention.scorer: '{oracle}'"):
            SparseAttentionConfig(scorer=oracle)


def test_true_recall_without_a_forward_lse_matches_with_it():
    """Flex off CUDA returns no log-sum-exp: the sampled queries' kept lse is computed
    from the table instead, and gives the same measurement."""
    q, k, v, doc_id = _inputs()
    scale = q.shape[-1] ** -0.5
    table, _ = select(q, k, doc_id, 0.4, policy="topk", block_size=64, scale=scale)
    _, lse = attention_forward(q, k, v, doc_id, table, scale, "torch")
    given = measure_true_recall(q, k, doc_id, lse, table, scale=scale, rate=1.0, lse_base2=False)
    own = measure_true_recall(q, k, doc_id, None, table, scale=scale, rate=1.0, lse_base2=False)
    for a, b in zip(given, own, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
