"""What SAB produces: a step plan of pieces of samples, per DP rank and micro-batch.

Plans are metadata only (sample ids and token ranges), identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Piece:
    """A contiguous token range [start, start + length) of one sample."""

    sample_id: int
    start: int
    length: int


@dataclass(slots=True)
class MicroBatchPlan:
    rows: list[list[Piece]]
    predicted_s: float = 0.0
    densities: list[float] = field(default_factory=list)
    """Expected density of each piece, in `doc_lens` order (what `predicted_s` used)."""
    recalls: list[list[float]] | None = None
    """Each piece's sample's last measured recall, in `doc_lens` order: [budget, kept
    mass of its budget-sensitive tokens, weight], NaN where never measured; None when no
    sample of the run has been (sab.Planner.observe_recalls)."""

    @property
    def doc_lens(self) -> list[int]:
        return [p.length for row in self.rows for p in row]

    @property
    def num_tokens(self) -> int:
        return sum(self.doc_lens)


@dataclass(slots=True)
class StepPlan:
    step: int  # planner step counter (0-based, counts every planned step)
    epoch: int  # epoch the sample cursor was in when the step was planned
    microbatches: list[list[MicroBatchPlan]]  # [dp_rank][microbatch]
