"""Step planning: which document pieces go to which (DP rank, micro-batch, row).

Every rank runs the same planner over the same metadata (sample lengths), so every
rank derives the same global plan without communication and then reads only its own
samples' tokens. Policies:
  - `sequential`: pack in data order (the common baseline).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

POLICIES = ("sequential",)
LONG_DOC_MODES = ("split", "truncate", "drop")


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

    @property
    def doc_lens(self) -> list[int]:
        return [p.length for row in self.rows for p in row]

    @property
    def num_tokens(self) -> int:
        return sum(self.doc_lens)


@dataclass(slots=True)
class StepPlan:
    step: int  # planner step counter (0-based, counts every planned step)
    epoch: int  # epoch of the first piece of the step
    microbatches: list[list[MicroBatchPlan]]  # [dp_rank][microbatch]


@dataclass(kw_only=True, slots=True)
class SABConfig:
    policy: str = "sequential"
    """Packing policy: one of POLICIES."""
    long_docs: str = "split"
    """Documents longer than a row: `split` into row-sized chunks, `truncate`, or `drop`."""
    shuffle: bool = True
    """Visit samples in a seeded random order each epoch (else in id order)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"sab.policy: unknown policy {self.policy!r}; expected one of {POLICIES}"
            )
        if self.long_docs not in LONG_DOC_MODES:
            raise ValueError(
                f"sab.long_docs: unknown mode {self.long_docs!r}; expected one of {LONG_DOC_MODES}"
            )


CostFn = Callable[[Sequence[int]], float]
"""Predicted latency (seconds) of one micro-batch from its document lengths."""


@dataclass(slots=True)
class _State:
    epoch: int = 0
    cursor: int = 0  # next position in the epoch's sample order
    step: int = 0
    pending: list[Piece] = field(default_factory=list)  # pieces carried to the next step
    dropped: int = 0  # samples dropped under long_docs="drop" (counted, logged)


class Planner:
    """Deterministic, resumable global step planner.

    State is (epoch, cursor, carried-over pieces, step); a restored planner produces
    exactly the steps the original would have produced next.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        *,
        seq_len: int,
        dp: int,
        microbatches: int,
        rows_per_microbatch: int,
        config: SABConfig,
        cost_fn: CostFn,
    ) -> None:
        if len(lengths) == 0:
            raise ValueError("Planner: the dataset has no samples")
        if min(seq_len, dp, microbatches, rows_per_microbatch) < 1:
            raise ValueError("Planner: seq_len, dp, microbatches and rows must be >= 1")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.seq_len = seq_len
        self.dp = dp
        self.microbatches = microbatches
        self.rows = rows_per_microbatch
        self.config = config
        self.cost_fn = cost_fn
        self.state = _State()

    # -- sample order -------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.config.shuffle:
            return np.arange(len(self.lengths))
        return np.random.default_rng([self.config.seed, epoch]).permutation(len(self.lengths))

    def pieces_of(self, sample_id: int) -> list[Piece]:
        """Split a sample into row-sized pieces (or truncate/drop it)."""
        n = int(self.lengths[sample_id])
        if n <= self.seq_len:
            return [Piece(sample_id, 0, n)]
        mode = self.config.long_docs
        if mode == "drop":
            self.state.dropped += 1
            return []
        if mode == "truncate":
            return [Piece(sample_id, 0, self.seq_len)]
        return [Piece(sample_id, s, min(self.seq_len, n - s)) for s in range(0, n, self.seq_len)]

    def _next_piece(self) -> Piece:
        st = self.state
        while not st.pending:
            order = self.epoch_order(st.epoch)
            if st.cursor >= len(order):
                st.epoch += 1
                st.cursor = 0
                continue
            st.pending.extend(self.pieces_of(int(order[st.cursor])))
            st.cursor += 1
        return st.pending.pop(0)

    # -- planning -----------------------------------------------------------------
    def next_step(self) -> StepPlan:
        epoch = self.state.epoch
        rows = self._plan_sequential()
        plan = self._group(rows, epoch)
        self.state.step += 1
        return plan

    def _plan_sequential(self) -> list[list[Piece]]:
        """Fill rows in data order; a piece that does not fit starts the next row."""
        n_rows = self.dp * self.microbatches * self.rows
        rows: list[list[Piece]] = [[]]
        used = 0
        while True:
            piece = self._next_piece()
            if used + piece.length > self.seq_len:
                if len(rows) == n_rows:
                    self.state.pending.insert(0, piece)
                    return rows
                rows.append([])
                used = 0
            rows[-1].append(piece)
            used += piece.length

    def _group(self, rows: list[list[Piece]], epoch: int) -> StepPlan:
        """Rows in order → rank-major micro-batches, each with its predicted latency."""
        mbs = []
        for r in range(self.dp):
            rank_mbs = []
            for m in range(self.microbatches):
                first = (r * self.microbatches + m) * self.rows
                mb = MicroBatchPlan(rows=rows[first : first + self.rows])
                mb.predicted_s = self.cost_fn(mb.doc_lens)
                rank_mbs.append(mb)
            mbs.append(rank_mbs)
        return StepPlan(step=self.state.step, epoch=epoch, microbatches=mbs)

    # -- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict:
        st = self.state
        return {
            "epoch": st.epoch,
            "cursor": st.cursor,
            "step": st.step,
            "pending": [[p.sample_id, p.start, p.length] for p in st.pending],
            "dropped": st.dropped,
            "policy": self.config.policy,
            "seed": self.config.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.config.seed:
            raise ValueError(
                f"data loader checkpoint was made with sab.seed={state['seed']}, "
                f"but the config has sab.seed={self.config.seed}"
            )
        self.state = _State(
            epoch=state["epoch"],
            cursor=state["cursor"],
            step=state["step"],
            pending=[Piece(*p) for p in state["pending"]],
            dropped=state["dropped"],
        )
