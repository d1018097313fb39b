"""Block-mass estimator: how much attention each (query block, key block) pair is worth.

Mean-pool Q per block (and over the G query heads that share a kv head) and K per
block, score the pooled pairs like attention logits, and take a softmax over the key
blocks a query block may see. The result is an *estimated* share of each query block's
attention mass per key block; selection keeps the pairs that cover a budget of it.

Documents are contiguous and doc ids non-decreasing, so the key blocks a query block i
may see form one range [sink(i), i]: sink(i) is the block holding the first token of
the document that block i starts in. Everything below works with that range instead of
an [NB, NB] mask, and scores are built for a range of query blocks at a time so that
selection's peak memory is O(chunk * NB), never O(NB^2) (let alone O(L^2)).

Two implementations of the same estimator: this file's PyTorch one, and the Triton
kernels in sb_titan_kernels.estimator (pooling + probabilities for a range of query
blocks). `block_mass_chunks` runs either, chunk by chunk, for selection.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from sb_titan.attention.backends import check_estimator, kernels


def num_blocks(seq_len: int, block_size: int) -> int:
    """NB = ceil(L / Bs); the last block may be partial."""
    return -(-seq_len // block_size)


def token_doc_start(doc_id: torch.Tensor) -> torch.Tensor:
    """[B, L] int64: position of the first token of each token's document."""
    B, L = doc_id.shape
    pos = torch.arange(L, device=doc_id.device).expand(B, L)
    is_start = torch.ones_like(doc_id, dtype=torch.bool)
    is_start[:, 1:] = doc_id[:, 1:] != doc_id[:, :-1]
    return torch.cummax(torch.where(is_start, pos, 0), dim=1).values


def attending(doc_id: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: the token's document has >= 2 tokens (padding and one-token documents
    attend to nothing but themselves)."""
    same_prev = torch.zeros_like(doc_id, dtype=torch.bool)
    same_prev[:, 1:] = doc_id[:, 1:] == doc_id[:, :-1]
    same_next = torch.zeros_like(same_prev)
    same_next[:, :-1] = same_prev[:, 1:]
    return same_prev | same_next


def block_first_doc(doc_id: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, NB]: document of the first token of each block."""
    return doc_id[:, ::block_size]


def block_last_doc(doc_id: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, NB]: document of the last (real) token of each block."""
    L = doc_id.shape[1]
    nb = num_blocks(L, block_size)
    ends = torch.arange(1, nb + 1, device=doc_id.device) * block_size
    return doc_id[:, ends.clamp(max=L) - 1]


def sink_blocks(doc_id: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, NB] int64: start block of first_doc(i), i.e. the first key block i may see."""
    return token_doc_start(doc_id)[:, ::block_size] // block_size


def pool_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, H, L, D] -> [B, H, NB, D] float32 mean over the real tokens of each block."""
    B, H, L, D = x.shape
    nb = num_blocks(L, block_size)
    pad = nb * block_size - L
    x = x.float()
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    sums = x.view(B, H, nb, block_size, D).sum(dim=3)
    counts = torch.full((nb,), float(block_size), device=x.device)
    counts[-1] = block_size - pad
    return sums / counts[:, None]


def pool_query_blocks(q: torch.Tensor, num_kv_heads: int, block_size: int) -> torch.Tensor:
    """[B, Hq, L, D] -> [B, Hkv, NB, D]: block mean, then mean over each GQA group."""
    B, Hq, L, D = q.shape
    qp = pool_blocks(q, block_size)
    return qp.view(B, num_kv_heads, Hq // num_kv_heads, -1, D).mean(dim=2)


def allowed_blocks(sink: torch.Tensor, start: int, end: int, nb: int) -> torch.Tensor:
    """[B, 1, end-start, NB] bool: key block j allowed for query block i iff sink(i) <= j <= i."""
    i = torch.arange(start, end, device=sink.device)
    j = torch.arange(nb, device=sink.device)
    upper = j[None, :] <= i[:, None]
    lower = j[None, None, :] >= sink[:, start:end, None]
    return (upper[None] & lower)[:, None]


def block_mass_from_pooled(
    qp: torch.Tensor,
    kp: torch.Tensor,
    sink: torch.Tensor,
    start: int,
    end: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Estimated mass for query blocks [start, end) from pooled q/k; see estimate_block_mass."""
    nb = kp.shape[2]
    scores = torch.matmul(qp[:, :, start:end], kp.transpose(-1, -2)) * scale
    allowed = allowed_blocks(sink, start, end, nb)
    prob = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return prob, allowed.expand_as(prob)


def estimate_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_id: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    q_block_range: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Estimated attention mass per block pair, per kv head.

    q: [B, Hq, L, D]; k: [B, Hkv, L, D]; doc_id: [B, L]. Returns (prob, allowed), both
    [B, Hkv, n, NB] for the n query blocks in q_block_range (default: all): prob is
    float32 and sums to 1 over each query block's allowed key blocks, 0 elsewhere.
    """
    Hkv, L, D = k.shape[1], k.shape[2], k.shape[3]
    nb = num_blocks(L, block_size)
    start, end = q_block_range if q_block_range is not None else (0, nb)
    if not 0 <= start < end <= nb:
        raise ValueError(f"q_block_range {q_block_range} is not within [0, {nb}]")
    scale = D**-0.5 if scale is None else scale
    qp = pool_query_blocks(q, Hkv, block_size)
    kp = pool_blocks(k, block_size)
    return block_mass_from_pooled(qp, kp, sink_blocks(doc_id, block_size), start, end, scale)


def block_mass_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_id: torch.Tensor,
    sink: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    chunk_blocks: int,
    estimator: str = "torch",
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(start, prob, allowed) per chunk of query blocks [start, start + chunk_blocks).

    Pools q/k once, then yields [B, Hkv, n, NB] masses one chunk at a time (peak memory
    O(chunk * NB)). `estimator` picks PyTorch or the Triton kernels; both compute the
    same fp32 softmax over sink(i) <= j <= i and differ only in rounding.
    `sink` is sink_blocks(doc_id, block_size), which the caller needs anyway.
    """
    check_estimator(estimator, q.device.type)
    Hkv, L = k.shape[1], k.shape[2]
    nb = num_blocks(L, block_size)
    if estimator == "triton":
        block_probs_triton = kernels().block_probs_triton
        qp, kp = kernels().pool_blocks_triton(q, k, block_size)
        doc32 = doc_id.to(torch.int32).contiguous()

        def chunk(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
            prob = block_probs_triton(qp, kp, doc32, block_size, start, end, scale, dtype=q.dtype)
            return prob, allowed_blocks(sink, start, end, nb).expand_as(prob)

    else:
        qp, kp = pool_query_blocks(q, Hkv, block_size), pool_blocks(k, block_size)

        def chunk(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
            return block_mass_from_pooled(qp, kp, sink, start, end, scale)

    for start in range(0, nb, chunk_blocks):
        yield (start, *chunk(start, min(start + chunk_blocks, nb)))
