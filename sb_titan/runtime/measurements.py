"""How the trainer gathers one step's measurements from every rank, for the balancer
(balance/measurements.py: StepMeasurements and what is learnt from it).

They travel as one fixed-size float64 tensor per rank (encode/decode below), so a step
costs one tensor all-gather, not a pickle per rank: float64 holds every value exactly
(Python floats, small integers, fp32 stats), so decoded measurements equal the local
ones bit for bit and every rank refits identically."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sb_titan.attention.selection import BLOCK_FIELDS, STATS_SIZE

_HEADER = 5  # dp, pp, cp, step_seconds, micro-batches per step
_ROW = 3 + STATS_SIZE  # timed?, seconds, stats?, then the stats in STATS_FIELDS order
DOC_FIELDS = len(BLOCK_FIELDS)  # per document, the query blocks' sums it was credited
DocCounts = list[list[int]]  # [dp rank][micro-batch]: documents, in the plan's order


def measurement_size(microbatches: int, doc_counts: DocCounts | None = None) -> int:
    """Length of one rank's encoded measurements for a step of `microbatches`; with
    `doc_counts` ([dp rank][micro-batch] documents, from the plan), room for the sampled
    sums of as many documents as any DP rank's micro-batches hold (every rank sends the
    same length)."""
    return _HEADER + _ROW * microbatches + DOC_FIELDS * _doc_slots(doc_counts)


def _doc_slots(doc_counts: DocCounts | None) -> int:
    return max((sum(rank) for rank in doc_counts), default=0) if doc_counts else 0


def encode_measurements(
    local: dict, microbatches: int, doc_counts: DocCounts | None = None
) -> torch.Tensor:
    """One rank's measurements ({"dp", "pp", "seconds", "stats", "step_seconds"}, and "cp"
    under context parallelism: absent means 0) as a float64 vector of
    measurement_size(microbatches, doc_counts). A micro-batch this rank did not time
    or has no stats for is flagged absent (a PP stage or rank sees only some). With
    `doc_counts`, local["doc_sums"][mb] holds each document of micro-batch mb's
    DOC_FIELDS sums (layout.document_sums), micro-batch after micro-batch; zeros where
    absent, as the sums of a document add up over stages and CP shards."""
    rows = [[0.0] * _ROW for _ in range(microbatches)]

    def row(mb: int) -> list[float]:
        if not 0 <= mb < microbatches:
            raise ValueError(f"micro-batch {mb}: expected 0..{microbatches - 1}")
        return rows[mb]

    for mb, s in local["seconds"].items():
        row(mb)[0:2] = [1.0, s]
    for mb, v in local["stats"].items():
        if len(v) != STATS_SIZE:
            raise ValueError(f"micro-batch {mb} stats: expected {STATS_SIZE} values, got {len(v)}")
        row(mb)[2:_ROW] = [1.0, *v]
    header = [local["dp"], local["pp"], local.get("cp", 0), local["step_seconds"], microbatches]
    flat = [float(x) for x in header] + [x for row in rows for x in row]
    docs = [0.0] * (DOC_FIELDS * _doc_slots(doc_counts))
    at = 0
    for mb, n in enumerate(doc_counts[local["dp"]] if doc_counts else []):
        sums = local.get("doc_sums", {}).get(mb)
        if sums is not None:
            if len(sums) != n or any(len(v) != DOC_FIELDS for v in sums):
                raise ValueError(f"micro-batch {mb}: expected {n} documents x {DOC_FIELDS} sums")
            docs[at : at + DOC_FIELDS * n] = [float(x) for v in sums for x in v]
        at += DOC_FIELDS * n
    return torch.tensor(flat + docs, dtype=torch.float64)


def decode_measurements(
    gathered: torch.Tensor, microbatches: int, doc_counts: DocCounts | None = None
) -> list[dict]:
    """Every rank's measurements from the all-gathered vectors (world x size, any shape
    that flattens to it), in the form StepMeasurements.from_gathered takes (with
    `doc_counts`, "doc_sums" holds every micro-batch of the rank's DP rank)."""
    size = measurement_size(microbatches, doc_counts)
    table = _HEADER + _ROW * microbatches
    flat = gathered.detach().reshape(-1).cpu().tolist()
    if len(flat) % size:
        raise ValueError(f"gathered measurements: {len(flat)} values, not a multiple of {size}")
    out = []
    for at in range(0, len(flat), size):
        dp, pp, cp, step_seconds, n = flat[at : at + _HEADER]
        if n != microbatches:
            raise ValueError(f"rank sent {n:g} micro-batches per step, expected {microbatches}")
        rows = [flat[i : i + _ROW] for i in range(at + _HEADER, at + table, _ROW)]
        got = {
            "dp": int(dp),
            "pp": int(pp),
            "cp": int(cp),
            "seconds": {mb: r[1] for mb, r in enumerate(rows) if r[0]},
            "stats": {mb: r[3:_ROW] for mb, r in enumerate(rows) if r[2]},
            "step_seconds": step_seconds,
        }
        if doc_counts:
            got["doc_sums"], i = {}, at + table
            for mb, count in enumerate(doc_counts[int(dp)]):
                got["doc_sums"][mb] = [
                    flat[j : j + DOC_FIELDS] for j in range(i, i + DOC_FIELDS * count, DOC_FIELDS)
                ]
                i += DOC_FIELDS * count
        out.append(got)
    return out


def all_gather_flat(x: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `x`, concatenated in rank order: one collective on gloo and NCCL
    (gloo takes only the flat output form; NCCL needs `x` on the rank's device)."""
    out = x.new_empty(dist.get_world_size() * x.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x)
    return out
