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

`int4_max`'s quantization and block maxima live in sb_titan_kernels: the PyTorch
reference (block_max_naive.py, estimator="torch") and its Triton kernel (block_max.py,
estimator="triton": CUDA or TRITON_INTERPRET=1), bitwise equal. They are imported on
first use, so importing this module does not import Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

from sb_titan.attention.backends import kernels
from sb_titan.attention.estimator import (
    allowed_blocks,
    num_blocks,
    pool_query_blocks,
    token_doc_start,
)

Scorer = Literal["mean", "int4_max", "kmax", "pool8_max", "exact", "exact_max"]
SCORERS: tuple[str, ...] = get_args(Scorer)
ORACLES = ("exact", "exact_max")  # O(L^2): benches and eval, never a training default
SUB_BLOCK = 8  # pool8_max's sub-block length
SCORE_ELEMENTS = 1 << 24  # token-pair scores held at once (64 MiB of fp32) per sub-chunk

ChunkFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def check_scorer(scorer: str) -> None:
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; expected one of {SCORERS}")


_FROM_KERNELS = ("INT4_MAX", "quantize_int4")


def __getattr__(name: str):
    """`quantize_int4` / `INT4_MAX`, from sb_titan_kernels on first use (one copy)."""
    if name in _FROM_KERNELS:
        from sb_titan_kernels import block_max_naive

        return getattr(block_max_naive, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _softmax_over_allowed(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    prob = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.nan_to_num(prob, nan=0.0)


def _exact_probs(q, k, doc_start, start, end, block_size, scale, aggregate) -> torch.Tensor:
    """True block mass (`sum`, mean over tokens and heads) or max true probability (`max`)."""
    from sb_titan_kernels.block_max_naive import allowed_tokens, token_chunks

    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = []
    for t0, t1 in token_chunks(start, end, block_size, L, B * Hq * L, SCORE_ELEMENTS):
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
    estimator: str = "torch",
) -> ChunkFn:
    """chunk(start, end) -> (prob, allowed) [B, Hkv, end - start, NB] for a non-`mean`
    scorer; any precomputation (quantization, pooling) is done once, here. `estimator`
    ("torch" | "triton") picks `int4_max`'s block maxima: the PyTorch reference or the
    Triton kernel (bitwise equal); the other scorers run in PyTorch."""
    check_scorer(scorer)
    B, Hkv, L, D = k.shape
    nb = num_blocks(L, block_size)
    doc_start = token_doc_start(doc_id)

    def allowed(start: int, end: int) -> torch.Tensor:
        return allowed_blocks(sink, start, end, nb).expand(B, Hkv, end - start, nb)

    if scorer == "int4_max":
        chunk = _int4_max_chunks(q, k, doc_start, block_size, scale, estimator, allowed)

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


def _int4_max_chunks(q, k, doc_start, block_size, scale, estimator, allowed) -> ChunkFn:
    """`int4_max`: quantize once (int8 codes), then block maxima per chunk of query blocks."""
    from sb_titan_kernels.block_max_naive import block_max_ref, int4_codes

    codes = int4_codes(q, k)
    if estimator == "triton":
        block_max_triton = kernels().block_max_triton
        ds = doc_start.to(torch.int32)

        def block_max(start: int, end: int) -> torch.Tensor:
            return block_max_triton(*codes, ds, block_size, start, end)

    else:

        def block_max(start: int, end: int) -> torch.Tensor:
            return block_max_ref(*codes, doc_start, block_size, start, end)

    def chunk(start: int, end: int):
        s = block_max(start, end) * scale
        a = allowed(start, end)
        return _softmax_over_allowed(s, a), a

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
