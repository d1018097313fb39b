"""True recall and top-key hits, measured on sampled query rows.

Estimated recall is the estimator's own view of the mass it kept: it cannot see a block
it misjudges. True recall is the share of a query's exact softmax that lies in the kept
blocks. The forward already returns the log-sum-exp over the kept blocks, so per
sampled query t and head h it is exp(lse_kept - lse_full), and only lse_full is new:
one query against all its allowed keys, key-chunked, O(L * D) per sample. Beside it,
the top-key hit: whether the key of greatest true probability lies in a kept block. At
equal mean mass, it is what separates a selection that keeps the one block a fact lives
in from one that does not (docs/attention.md).

Sampling is one query per sampled query block, at an offset and with a choice of block
that hash the block index (no RNG: a resumed run samples the same rows, bitwise). Only
attending tokens (documents of >= 2 tokens, as estimated recall counts) are sampled.
At rate 1 the extra QK^T is 1/Bs of the dense row's, and there is no PV.
"""

from __future__ import annotations

import math

import torch

from sb_titan.attention.block_scores import SCORE_ELEMENTS
from sb_titan.attention.estimator import attending, num_blocks, token_doc_start

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor, salt: int) -> torch.Tensor:
    """A 32-bit integer mix (murmur3's finaliser) of int64 `x`; deterministic everywhere."""
    x = (x + salt) & _MASK32
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _MASK32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def sample_positions(
    doc_id: torch.Tensor, block_size: int, rate: float, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, NB] int64: the sampled query position of each query block, -1 where none.

    A block is sampled when the hash of its index falls under `rate`; its query is the
    token at a hashed offset (within the real tokens of a partial last block). `rows`
    [B, NB] bool restricts sampling to a CP shard's query blocks."""
    B, L = doc_id.shape
    nb = num_blocks(L, block_size)
    i = torch.arange(nb, device=doc_id.device, dtype=torch.int64)
    width = torch.clamp(L - i * block_size, max=block_size)
    pos = i * block_size + _hash32(i, 0x5BD1E995) % width
    chosen = _hash32(i, 0x27D4EB2F).double() < rate * 2.0**32
    pos = pos.expand(B, nb)
    ok = chosen[None] & attending(doc_id).gather(1, pos)
    if rows is not None:
        ok = ok & rows
    return torch.where(ok, pos, -1)


def sampled_full_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_id: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    kept_blocks: torch.Tensor | None = None,
    block_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Natural log-sum-exp over all allowed keys, and the key of greatest logit, of the
    queries at `pos` [B, S] (-1: unsampled, garbage out): ([B, Hq, S] fp32, [B, Hq, S] int64).
    kept_blocks [B, Hkv, S, NB] bool: only keys in those blocks (the kept log-sum-exp,
    for an attention that does not return its own).

    Keys are processed in chunks (peak memory O(S * chunk) per head), with an online
    max and sum as in flash attention."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    S = pos.shape[1]
    wd = _work_dtype(q)
    at = pos.clamp(min=0)
    qs = q.gather(2, at[:, None, :, None].expand(B, Hq, S, D)).to(wd)
    qs = qs.view(B, Hkv, G, S, D)
    start = token_doc_start(doc_id).gather(1, at)  # [B, S]
    m = qs.new_full((B, Hkv, G, S), float("-inf"))
    total = qs.new_zeros((B, Hkv, G, S))
    top = torch.zeros((B, Hkv, G, S), dtype=torch.int64, device=q.device)
    chunk = max(block_size, SCORE_ELEMENTS // max(B * Hq * S, 1) // block_size * block_size)
    for u0 in range(0, L, chunk):
        u = torch.arange(u0, min(u0 + chunk, L), device=q.device)
        logits = torch.matmul(qs, k[:, :, None, u0 : u0 + chunk].to(wd).transpose(-1, -2))
        logits = logits * scale
        ok = ((u[None, None, :] <= at[:, :, None]) & (u[None, None, :] >= start[:, :, None]))[
            :, None, None
        ]
        if kept_blocks is not None:
            ok = ok & kept_blocks[:, :, None, :, u // block_size]
        logits = logits.masked_fill_(~ok, float("-inf"))
        cmax, carg = logits.max(dim=-1)
        new_m = torch.maximum(m, cmax)
        live = torch.isfinite(new_m)
        total = torch.where(
            live,
            total * torch.exp(m - new_m) + torch.exp(logits - new_m[..., None]).sum(-1),
            total,
        )
        top = torch.where(cmax > m, carg + u0, top)
        m = new_m
    lse = m + torch.log(total)
    return lse.view(B, Hq, S), top.view(B, Hq, S)


def kept_block_mask(kv_ptr: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, NB, NB] bool of a CSR table (small L only: eval without a forward lse)."""
    B, Hkv, nb1 = kv_ptr.shape
    nb = nb1 - 1
    count = kv_ptr.diff(dim=-1).flatten()
    row = torch.repeat_interleave(
        torch.arange(count.numel(), device=kv_ptr.device), count, output_size=kv_index.numel()
    )
    out = torch.zeros(B * Hkv * nb * nb, dtype=torch.bool, device=kv_ptr.device)
    out[row * nb + kv_index.long()] = True
    return out.view(B, Hkv, nb, nb)


def kept_pairs(
    kv_ptr: torch.Tensor,
    kv_index: torch.Tensor,
    heads: torch.Tensor,
    query_block: torch.Tensor,
    key_block: torch.Tensor,
) -> torch.Tensor:
    """[B, H, S] bool: whether (b, kv head heads[h], query_block, key_block) is a kept
    pair of the CSR table: kept pairs flattened to one sorted key each, one searchsorted."""
    B, Hkv, nb1 = kv_ptr.shape
    nb = nb1 - 1
    count = kv_ptr.diff(dim=-1).flatten()
    row = torch.repeat_interleave(
        torch.arange(count.numel(), device=kv_ptr.device), count, output_size=kv_index.numel()
    )
    keys = row * nb + kv_index.long()  # ascending: rows in order, ids ascending per row
    bh = (torch.arange(B, device=kv_ptr.device)[:, None] * Hkv + heads[None]).view(B, -1, 1)
    want = (bh * nb + query_block) * nb + key_block
    at = torch.searchsorted(keys, want.flatten()).clamp(max=keys.numel() - 1)
    return (keys[at] == want.flatten()).view(want.shape)


@torch.no_grad()
def true_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_id: torch.Tensor,
    lse_kept: torch.Tensor | None,
    kv_ptr: torch.Tensor,
    kv_index: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    rate: float,
    lse_base2: bool = False,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(true recall sum, top-key hits, sampled pairs), each [B, NB] fp32 (fp64 for fp64):
    per query block, over its sampled query and all q heads (per block, so the trainer
    can credit each document with its own blocks' recall). lse_kept: [B, Hq, L] the forward's
    log-sum-exp over the kept blocks (base 2 from the Triton kernels: lse_base2), or
    None: computed here for the sampled queries alone."""
    B, Hq, L, _ = q.shape
    Hkv = k.shape[1]
    pos = sample_positions(doc_id, block_size, rate, rows)  # [B, NB]
    valid = pos >= 0
    full, top = sampled_full_lse(q, k, doc_id, pos, scale, block_size=block_size)  # [B, Hq, NB]
    if lse_kept is None:  # the attention did not return it (Flex off CUDA)
        blocks = kept_block_mask(kv_ptr, kv_index)
        kept, _ = sampled_full_lse(q, k, doc_id, pos, scale, blocks, block_size)
    else:
        kept = lse_kept.to(full.dtype).gather(2, pos.clamp(min=0)[:, None].expand(B, Hq, -1))
    if lse_base2:
        kept = kept * math.log(2.0)
    recall = torch.exp(kept - full).clamp(max=1.0)
    qb = torch.arange(pos.shape[1], device=q.device).expand(B, Hq, -1)
    heads = torch.arange(Hq, device=q.device) // (Hq // Hkv)
    hit = kept_pairs(kv_ptr, kv_index, heads, qb, top // block_size)
    v = valid[:, None].expand(B, Hq, -1)
    recall = torch.where(v, recall, 0.0).sum(dim=1)
    hits = (hit & v).sum(dim=1).to(recall.dtype)
    return recall, hits, v.sum(dim=1).to(recall.dtype)


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64 (the reference tests); everything else measures in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
