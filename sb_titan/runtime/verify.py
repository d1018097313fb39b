"""Debug checks that every rank holds the same plan (`[dst] verify_ranks`)."""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from sb_titan.balance.sab import StepPlan


def plan_digest(plan: StepPlan) -> str:
    """Hash of the whole global plan (every rank's pieces), to compare across ranks."""
    pieces = [
        (r, m, i, p.sample_id, p.start, p.length)
        for r, rank in enumerate(plan.microbatches)
        for m, mb in enumerate(rank)
        for i, row in enumerate(mb.rows)
        for p in row
    ]
    return hashlib.sha1(repr((plan.step, pieces)).encode()).hexdigest()


def assert_same_everywhere(digest: str, what: str) -> None:
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks disagree on {what}: {digests}")
