"""PyTorch reference of the `int4_max` block scorer: per-token int4 codes, max logit per block.

Per row b, kv head h, query block i (tokens [i*Bs, min((i+1)*Bs, L))) and key block j:

    S[b, h, i, j] = max over the G q heads g of h (q head h*G + g), query tokens t of
                    block i and key tokens u of block j with doc_start(t) <= u <= t of
                    (Qc[b, g, t] . Kc[b, h, u]) * qs[b, g, t] * ks[b, h, u]

and -inf where no token pair is allowed. Qc / Kc are symmetric per-token int4 codes in
[-7, 7] (k is centred first: its mean over L per row and head is subtracted, a shift
that is one constant per query, so the softmax over keys is unchanged and the codes
spend their range on what varies), qs / ks their fp32 scales. The integer dot is exact
in fp32 (|dot| <= 49 * D < 2^24), and the two products are taken in this order, so the
Triton kernel (block_max.py), which takes the dot in int32, is bitwise equal to this.

The caller (sb_titan.attention.block_scores) multiplies by the softmax scale and takes
a softmax over the allowed key blocks; both stay in PyTorch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

INT4_MAX = 7  # symmetric int4 codes in [-7, 7]
MAX_SCORES = 1 << 22  # default: token-pair scores held at once (16 MiB of fp32); smaller
# chunks skip more of the causal upper triangle


class Int4Codes(NamedTuple):
    """`int4_max`'s inputs: int8 codes in [-7, 7] and fp32 per-token scales [B, H, L]."""

    q_codes: torch.Tensor  # [B, Hq, L, D] int8
    q_scale: torch.Tensor  # [B, Hq, L] fp32
    k_codes: torch.Tensor  # [B, Hkv, L, D] int8, of k minus its mean over L
    k_scale: torch.Tensor  # [B, Hkv, L] fp32


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int4: (codes in [-7, 7] as fp32, scale [..., 1] fp32)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))
    return torch.round(x.float() / scale).clamp_(-INT4_MAX, INT4_MAX), scale


def int4_codes(q: torch.Tensor, k: torch.Tensor) -> Int4Codes:
    """Quantize q and the centred k once; codes as int8 (a quarter of fp32's memory)."""
    qc, qs = quantize_int4(q)
    kf = k.float()
    kc, ks = quantize_int4(kf - kf.mean(dim=2, keepdim=True))
    return Int4Codes(qc.to(torch.int8), qs.squeeze(-1), kc.to(torch.int8), ks.squeeze(-1))


def num_blocks(seq_len: int, block_size: int) -> int:
    """NB = ceil(L / Bs); the last block may be partial."""
    return -(-seq_len // block_size)


def allowed_tokens(doc_start: torch.Tensor, t0: int, t1: int, L: int) -> torch.Tensor:
    """[B, T, L] bool: query token t in [t0, t1) may attend key u iff start(t) <= u <= t."""
    t = torch.arange(t0, t1, device=doc_start.device)
    u = torch.arange(L, device=doc_start.device)
    return (u[None, None, :] <= t[None, :, None]) & (u[None, None, :] >= doc_start[:, t0:t1, None])


def token_chunks(
    start: int, end: int, block_size: int, L: int, per_token: int, max_scores: int = MAX_SCORES
) -> Iterator[tuple[int, int]]:
    """Query-token ranges [t0, t1) of whole blocks within blocks [start, end), each
    holding at most `max_scores` scores of `per_token` elements per query token (one
    block at least)."""
    step = max(1, max_scores // max(per_token * block_size, 1)) * block_size
    for t0 in range(start * block_size, min(end * block_size, L), step):
        yield t0, min(t0 + step, end * block_size)


def _block_max(x: torch.Tensor, block_size: int, L: int) -> torch.Tensor:
    """[B, H, T, L] with T a multiple of Bs -> [B, H, T / Bs, NB]: max per block pair."""
    B, H, T, _ = x.shape
    nb = num_blocks(L, block_size)
    x = torch.nn.functional.pad(x, (0, nb * block_size - L), value=float("-inf"))
    return x.view(B, H, T // block_size, block_size, nb, block_size).amax(dim=(3, 5))


def block_max_ref(
    q_codes: torch.Tensor,
    q_scale: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    doc_start: torch.Tensor,
    block_size: int,
    start: int = 0,
    end: int | None = None,
    max_scores: int = MAX_SCORES,
) -> torch.Tensor:
    """S [B, Hkv, end - start, NB] fp32 (unscaled logits, -inf where no pair is allowed)
    for query blocks [start, end). Codes: any dtype holding the integers (int8, fp32);
    scales [B, H, L] or [B, H, L, 1]; doc_start [B, L]: each token's document start.
    Token-chunked: about `max_scores` token-pair scores are held at once.

    Two shortcuts keep it within a small factor of one QK^T on a CPU, and change no bit:
    a chunk of queries scores only the keys from its earliest document start to its last
    query (no other key is allowed), and the max over a kv head's G q heads is taken
    before the key scale: ks > 0 and rounding is monotone, so max_g(x_g) * ks is
    max_g(x_g * ks) exactly."""
    B, Hq, L, D = q_codes.shape
    Hkv = k_codes.shape[1]
    G = Hq // Hkv
    end = num_blocks(L, block_size) if end is None else end
    qs = q_scale.reshape(B, Hq, L).float()
    ks = k_scale.reshape(B, Hkv, 1, L).float()
    kc = k_codes.float().transpose(-1, -2)[:, :, None]  # [B, Hkv, 1, D, L]
    out = []
    for t0, t1 in token_chunks(start, end, block_size, L, B * Hq * L, max_scores):
        t1r = min(t1, L)
        k0 = int(doc_start[:, t0:t1r].min()) // block_size * block_size  # whole blocks
        qg = q_codes[:, :, t0:t1r].float().reshape(B, Hkv, G, t1r - t0, D)
        dots = torch.matmul(qg, kc[..., k0:t1r])  # exact: integers, every partial sum < 2^24
        best = (dots * qs[:, :, t0:t1r].reshape(B, Hkv, G, t1r - t0, 1)).amax(dim=2)
        best = best * ks[..., k0:t1r]
        best.masked_fill_(~allowed_tokens(doc_start, t0, t1r, L)[:, None, :, k0:t1r], -torch.inf)
        # keys outside [k0, t1r) and rows past L (a partial last block) hold no pair: -inf
        best = torch.nn.functional.pad(best, (k0, L - t1r, 0, t1 - t1r), value=-torch.inf)
        out.append(_block_max(best, block_size, L))
    return torch.cat(out, dim=2)


def block_max_int4_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_start: torch.Tensor,
    block_size: int,
    start: int = 0,
    end: int | None = None,
) -> torch.Tensor:
    """Quantize (int4_codes), then block_max_ref: `int4_max`'s unscaled block maxima."""
    return block_max_ref(*int4_codes(q, k), doc_start, block_size, start, end)
