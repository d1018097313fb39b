"""`int4_max` block scorer: the max int4 logit of every allowed (query block, key block) pair.

S[b, h, i, j] = max over the G q heads of kv head h, query tokens t of block i and key
tokens u of block j with doc_start(t) <= u <= t of (Qc[t] . Kc[u]) * qs[t] * ks[u]; -inf
where no token pair is allowed (block_max_naive.py defines it and is the reference).

One program per (query block i, row b x kv head h) walks the key blocks j in
[sink(i), i] (sink(i): the block holding the start of i's first token's document) and,
per BLOCK_M x BLOCK_N sub-tile of the pair, loops over the G q heads: an int8 x int8 ->
int32 `tl.dot` (an integer MMA, exact), `.to(fp32) * qs` and a running max over the
heads, then `* ks`, the token mask and the max into S[i, j]. Taking the head max before
`* ks` is exact: ks > 0 and rounding is monotone, so max_g(x_g) * ks rounds to
max_g(x_g * ks). The products are the reference's, in its order, so the kernel is
bitwise equal to it. Every output element is written (-inf outside [sink(i), i]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_max_naive import int4_codes, num_blocks
from .common import Tile, launch_opts

# (head_dim, block size Bs) -> (BLOCK_M query rows, BLOCK_N key rows, warps, stages).
# Codes are int8 whatever the model's dtype, so there is one table for every dtype.
# From `python bench/kernels_report.py --sweep --kernels block_max` (the attention
# table's rule: spill-free with mma_ratio 1 on sm_80 and sm_90a, then the largest tile).
BLOCK_MAX_CONFIGS: dict[tuple[int, int], Tile] = {
    (64, 64): Tile(64, 64, 4, 3),
    (64, 128): Tile(128, 128, 8, 3),
    (128, 64): Tile(64, 64, 4, 3),
    (128, 128): Tile(128, 128, 8, 3),
}


def block_max_tile(head_dim: int, block_size: int) -> Tile:
    key = (head_dim, block_size)
    if key not in BLOCK_MAX_CONFIGS:
        raise ValueError(f"no block-max config for D={head_dim} Bs={block_size}")
    return BLOCK_MAX_CONFIGS[key]


@triton.jit
def _block_max_kernel(
    QC, QS, KC, KS, DOC_START, SCORE,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_db,
    seq_len, num_blocks, num_kv_heads, group, start, n_rows,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_i = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b64 = (pid_bh // num_kv_heads).to(tl.int64)
    hk64 = (pid_bh % num_kv_heads).to(tl.int64)
    i = start + pid_i
    q0 = i * BLOCK_SIZE
    doc_base = DOC_START + b64 * stride_db
    sink = tl.load(doc_base + q0) // BLOCK_SIZE
    out = SCORE + (pid_bh.to(tl.int64) * n_rows + pid_i) * num_blocks

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # blocks outside [sink, i] hold no allowed pair
    ninf = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for c0 in range(0, num_blocks, BLOCK_N):
        cols = c0 + offs_n
        tl.store(out + cols, ninf, mask=(cols < num_blocks) & ((cols < sink) | (cols > i)))

    q_head0 = QC + b64 * stride_qb + hk64 * group * stride_qh
    qs_head0 = QS + (b64 * num_kv_heads + hk64) * group * seq_len
    k_base = KC + b64 * stride_kb + hk64 * stride_kh
    ks_base = KS + (b64 * num_kv_heads + hk64) * seq_len
    SUB_N: tl.constexpr = BLOCK_SIZE // BLOCK_N
    SUBTILES: tl.constexpr = (BLOCK_SIZE // BLOCK_M) * SUB_N
    for j in range(sink, i + 1):
        best = tl.full([], float("-inf"), tl.float32)
        for sub in range(0, SUBTILES):
            rows = q0 + (sub // SUB_N) * BLOCK_M + offs_m
            cols = j * BLOCK_SIZE + (sub % SUB_N) * BLOCK_N + offs_n
            row_ok = rows < seq_len
            col_ok = cols < seq_len
            k = tl.load(
                k_base + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                mask=col_ok[:, None], other=0,
            )  # fmt: skip
            # max over the G heads of dot * qs (ks > 0 is applied once, after)
            acc = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
            for g in range(0, group):
                q = tl.load(
                    q_head0 + g * stride_qh + rows[:, None].to(tl.int64) * stride_qm
                    + offs_d[None, :],
                    mask=row_ok[:, None], other=0,
                )  # fmt: skip
                qs = tl.load(qs_head0 + g * seq_len + rows, mask=row_ok, other=0.0)
                dot = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
                acc = tl.maximum(acc, dot.to(tl.float32) * qs[:, None])
            ks = tl.load(ks_base + cols, mask=col_ok, other=0.0)
            # rows past L get a document start no key reaches
            ds = tl.load(doc_base + rows, mask=row_ok, other=2147483647)
            ok = (cols[None, :] <= rows[:, None]) & (cols[None, :] >= ds[:, None])
            s = tl.where(ok, acc * ks[None, :], float("-inf"))
            best = tl.maximum(best, tl.max(tl.max(s, 1), 0))
        tl.store(out + j, best)


def block_max_triton(
    q_codes: torch.Tensor,
    q_scale: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    doc_start: torch.Tensor,
    block_size: int,
    start: int = 0,
    end: int | None = None,
) -> torch.Tensor:
    """S [B, Hkv, end - start, NB] fp32 for query blocks [start, end): block_max_ref's
    result, bitwise. q_codes [B, Hq, L, D] / k_codes [B, Hkv, L, D] int8 in [-7, 7] (any
    strides with a unit last dimension); scales [B, H, L] (or [B, H, L, 1]) fp32 > 0;
    doc_start [B, L]: each token's document start (any integer dtype)."""
    B, Hq, L, D = q_codes.shape
    Hkv = k_codes.shape[1]
    if k_codes.shape != (B, Hkv, L, D) or Hq % Hkv:
        raise ValueError(f"bad shapes q={tuple(q_codes.shape)} k={tuple(k_codes.shape)}")
    if q_codes.dtype != torch.int8 or k_codes.dtype != torch.int8:
        raise ValueError(f"codes must be int8, got {q_codes.dtype} and {k_codes.dtype}")
    if doc_start.shape != (B, L):
        raise ValueError(f"doc_start must be [B, L] = {(B, L)}, got {tuple(doc_start.shape)}")
    nb = num_blocks(L, block_size)
    end = nb if end is None else end
    if not 0 <= start < end <= nb:
        raise ValueError(f"need 0 <= start < end <= NB, got start={start} end={end} NB={nb}")
    t = block_max_tile(D, block_size)
    qc = q_codes if q_codes.stride(-1) == 1 else q_codes.contiguous()
    kc = k_codes if k_codes.stride(-1) == 1 else k_codes.contiguous()
    qs = q_scale.reshape(B, Hq, L).float().contiguous()
    ks = k_scale.reshape(B, Hkv, L).float().contiguous()
    ds = doc_start.to(torch.int32).contiguous()
    score = torch.empty((B, Hkv, end - start, nb), device=qc.device, dtype=torch.float32)
    _block_max_kernel[(end - start, B * Hkv)](
        qc, qs, kc, ks, ds, score,
        qc.stride(0), qc.stride(1), qc.stride(2), kc.stride(0), kc.stride(1), kc.stride(2),
        ds.stride(0), L, nb, Hkv, Hq // Hkv, start, end - start,
        HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        **launch_opts(t),
    )  # fmt: skip
    return score


def block_max_int4_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_start: torch.Tensor,
    block_size: int,
    start: int = 0,
    end: int | None = None,
) -> torch.Tensor:
    """Quantize q and the centred k (int4 codes stored as int8), then launch the kernel."""
    return block_max_triton(*int4_codes(q, k), doc_start, block_size, start, end)
