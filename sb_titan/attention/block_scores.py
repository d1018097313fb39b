"""Block scores that see a single strong key: the estimator families beside `mean`.

`mean` (attention/estimator.py) scores a block pair by block-mean q · block-mean k. A
single strong key in a 64-token block is diluted 64-fold by the mean, so the block that
holds the one fact a query needs can rank below diffuse ones (docs/attention.md, "Which
blocks to keep"). The families here aggregate with a max instead, at three costs:

  `int4_max`   per-token q · k with q and k quantized to int4 per token (k centred per
               row and head first, as SageAttention and SALE do: a shift that is one
               constant per query, so softmax is unchanged and the codes spend their
               range on what varies), the max over the G query heads and the token pairs
               of each block pair. Like SALE. Cost: QK^T of dense attention, in int4/int8.
  `kmax`       block-mean q · per-token k, the max over each key block's tokens: sees a
               strong key, not a strong query. Cost: 1/Bs of dense QK^T.
  `pool8_max`  8-token sub-block means of q (per head) and k, the max over the sub-block
               pairs and the G heads. Cost: 1/64 of dense QK^T.
  `exact`      the oracle: each query token's true softmax, summed per key block and
               averaged over the block's tokens and the G heads (O(L^2), benches only).
  `exact_max`  the oracle by the strongest entry: the max true probability in the block.

Each returns, per chunk of query blocks, a distribution over the allowed key blocks
(sums to 1), which selection ranks (`topk`) or accumulates (`mass`): the max-logit
families take a softmax over their block maxima, `exact_max` normalises its maxima.
Every family masks tokens exactly (causal, same document), so a block pair's score
comes only from pairs the attention itself can compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

from sb_titan.attention.estimator import (
    allowed_blocks,
    num_blocks,
    pool_query_blocks,
    token_doc_start,
)

Scorer = Literal["mean", "int4_max", "kmax", "pool8_max", "exact", "exact_max"]
SCORERS: tuple[str, ...] = get_args(Scorer)
ORACLES = ("exact", "exact_max")  # O(L^2): benches and eval, never a training default
INT4_MAX = 7  # symmetric int4 codes in [-7, 7]
SUB_BLOCK = 8  # pool8_max's sub-block length
SCORE_ELEMENTS = 1 << 24  # token-pair scores held at once (64 MiB of fp32) per sub-chunk

ChunkFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def check_scorer(scorer: str) -> None:
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; expected one of {SCORERS}")


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int4: (codes in [-7, 7] as fp32, scale [..., 1] fp32)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))
    return torch.round(x.float() / scale).clamp_(-INT4_MAX, INT4_MAX), scale


def allowed_tokens(doc_start: torch.Tensor, t0: int, t1: int, L: int) -> torch.Tensor:
    """[B, T, L] bool: query token t in [t0, t1) may attend key u iff start(t) <= u <= t."""
    t = torch.arange(t0, t1, device=doc_start.device)
    u = torch.arange(L, device=doc_start.device)
    return (u[None, None, :] <= t[None, :, None]) & (u[None, None, :] >= doc_start[:, t0:t1, None])


def _block_max(x: torch.Tensor, block_size: int, L: int) -> torch.Tensor:
    """[B, H, T, L] with T a multiple of Bs -> [B, H, T / Bs, NB]: max per block pair."""
    B, H, T, _ = x.shape
    nb = num_blocks(L, block_size)
    x = torch.nn.functional.pad(x, (0, nb * block_size - L), value=float("-inf"))
    return x.view(B, H, T // block_size, block_size, nb, block_size).amax(dim=(3, 5))


def _token_chunks(start: int, end: int, block_size: int, L: int, per_token: int):
    """Query-token ranges [t0, t1) of whole blocks within blocks [start, end), each
    holding at most SCORE_ELEMENTS scores of `per_token` elements per query token."""
    step = max(1, SCORE_ELEMENTS // max(per_token * block_size, 1)) * block_size
    for t0 in range(start * block_size, min(end * block_size, L), step):
        yield t0, min(t0 + step, end * block_size)


def _pad_tokens(x: torch.Tensor, t1: int, L: int) -> torch.Tensor:
    """x [..., T, L'] for tokens up to min(t1, L): pad rows to t1 with -inf (past L)."""
    return torch.nn.functional.pad(x, (0, 0, 0, t1 - min(t1, L)), value=float("-inf"))


def _max_logit_tokens(q: torch.Tensor, k: torch.Tensor, doc_start, start, end, block_size):
    """`int4_max` block maxima [B, Hkv, n, NB] (unscaled logits) for query blocks [start, end)."""
    qc, qs = q
    kc, ks = k
    B, Hq, L, D = qc.shape
    Hkv = kc.shape[1]
    G = Hq // Hkv
    out = []
    for t0, t1 in _token_chunks(start, end, block_size, L, B * Hq * L):
        t1r = min(t1, L)
        qg = qc[:, :, t0:t1r].reshape(B, Hkv, G, t1r - t0, D)
        dots = torch.matmul(qg, kc[:, :, None].transpose(-1, -2))  # exact: |sum| < 2^24
        logits = dots * qs[:, :, t0:t1r].reshape(B, Hkv, G, t1r - t0, 1) * ks.view(B, Hkv, 1, 1, L)
        ok = allowed_tokens(doc_start, t0, t1r, L)[:, None, None]
        best = logits.masked_fill_(~ok, float("-inf")).amax(dim=2)  # over the G heads
        out.append(_block_max(_pad_tokens(best, t1, L), block_size, L))
    return torch.cat(out, dim=2)


def _softmax_over_allowed(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    prob = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.nan_to_num(prob, nan=0.0)


def _exact_probs(q, k, doc_start, start, end, block_size, scale, aggregate) -> torch.Tensor:
    """True block mass (`sum`, mean over tokens and heads) or max true probability (`max`)."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = []
    for t0, t1 in _token_chunks(start, end, block_size, L, B * Hq * L):
        t1r = min(t1, L)
        qg = q[:, :, t0:t1r].float().reshape(B, Hkv, G, t1r - t0, D)
        logits = torch.matmul(qg, k.float()[:, :, None].transpose(-1, -2)) * scale
        ok = allowed_tokens(doc_start, t0, t1r, L)[:, None, None]
        p = torch.softmax(logits.masked_fill_(~ok, float("-inf")), dim=-1)  # [B,Hkv,G,T,L]
        nb = num_blocks(L, block_size)
        p = torch.nn.functional.pad(p, (0, nb * block_size - L, 0, t1 - t1r))
        p = p.view(B, Hkv, G, (t1 - t0) // block_size, block_size, nb, block_size)
        if aggregate == "max":
            out.append(p.amax(dim=(2, 4, 6)))
        else:  # mean over the block's real query tokens and the heads
            real = (torch.arange(t0, t1, device=q.device) < L).view(-1, block_size).sum(-1)
            out.append(p.sum(dim=(2, 4, 6)) / (G * real.clamp(min=1)).view(1, 1, -1, 1))
    return torch.cat(out, dim=2)


def score_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_id: torch.Tensor,
    sink: torch.Tensor,
    *,
    scorer: str,
    block_size: int,
    scale: float,
) -> ChunkFn:
    """chunk(start, end) -> (prob, allowed) [B, Hkv, end - start, NB] for a non-`mean`
    scorer; any precomputation (quantization, pooling) is done once, here."""
    check_scorer(scorer)
    B, Hkv, L, D = k.shape
    nb = num_blocks(L, block_size)
    doc_start = token_doc_start(doc_id)

    def allowed(start: int, end: int) -> torch.Tensor:
        return allowed_blocks(sink, start, end, nb).expand(B, Hkv, end - start, nb)

    if scorer == "int4_max":
        qq = quantize_int4(q)
        kq = quantize_int4(k.float() - k.float().mean(dim=2, keepdim=True))

        def chunk(start: int, end: int):
            s = _max_logit_tokens(qq, kq, doc_start, start, end, block_size) * scale
            a = allowed(start, end)
            return _softmax_over_allowed(s, a), a

    elif scorer == "kmax":
        qp = pool_query_blocks(q, Hkv, block_size)  # [B, Hkv, NB, D]
        kf = k.float()
        first = doc_start[:, ::block_size]  # [B, NB]: first key the block's first token sees

        def chunk(start: int, end: int):
            logits = torch.matmul(qp[:, :, start:end], kf.transpose(-1, -2)) * scale
            u = torch.arange(L, device=q.device)
            ends = torch.arange(start + 1, end + 1, device=q.device) * block_size
            last = torch.clamp(ends, max=L)
            ok = (u[None, None, :] < last[None, :, None]) & (
                u[None, None, :] >= first[:, start:end, None]
            )
            logits = logits.masked_fill(~ok[:, None], float("-inf"))
            nbp = nb * block_size - L
            logits = torch.nn.functional.pad(logits, (0, nbp), value=float("-inf"))
            s = logits.view(B, Hkv, end - start, nb, block_size).amax(-1)
            a = allowed(start, end)
            return _softmax_over_allowed(s, a), a

    elif scorer == "pool8_max":
        chunk = _pool8_chunks(q, k, doc_id, block_size, scale, allowed)

    elif scorer in ORACLES:
        aggregate = "max" if scorer == "exact_max" else "sum"

        def chunk(start: int, end: int):
            p = _exact_probs(q, k, doc_start, start, end, block_size, scale, aggregate)
            a = allowed(start, end)
            p = p * a
            return p / p.sum(-1, keepdim=True).clamp(min=1e-30), a

    else:
        raise ValueError(f"scorer {scorer!r} is the block-mean estimator (estimator.py)")
    return chunk


def _pool8_chunks(q, k, doc_id, block_size: int, scale: float, allowed) -> ChunkFn:
    """`pool8_max`: sub-block means per head, masked by the sub-blocks' first tokens."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    sb = SUB_BLOCK
    per = block_size // sb
    qs8 = pool_query_blocks(q, Hq, sb).view(B, Hkv, G, -1, D)  # per head: G of them
    ks8 = pool_query_blocks(k, Hkv, sb)  # [B, Hkv, NS, D]
    ns = ks8.shape[2]
    sub_start = token_doc_start(doc_id)[:, ::sb] // sb  # [B, NS]: first sub-block of its doc
    nb = num_blocks(L, block_size)

    def chunk(start: int, end: int):
        a0, a1 = start * per, min(end * per, ns)
        logits = torch.matmul(qs8[:, :, :, a0:a1], ks8[:, :, None].transpose(-1, -2)) * scale
        a = torch.arange(a0, a1, device=q.device)
        b = torch.arange(ns, device=q.device)
        ok = (b[None, None, :] <= a[None, :, None]) & (
            b[None, None, :] >= sub_start[:, a0:a1, None]
        )
        best = logits.masked_fill(~ok[:, None, None], float("-inf")).amax(dim=2)
        pad = (0, nb * per - ns, 0, (end - start) * per - (a1 - a0))
        best = torch.nn.functional.pad(best, pad, value=float("-inf"))
        s = best.view(B, Hkv, end - start, per, nb, per).amax(dim=(3, 5))
        al = allowed(start, end)
        return _softmax_over_allowed(s, al), al

    return chunk
