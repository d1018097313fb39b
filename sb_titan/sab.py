"""Step planning (SAB): which document pieces go to which (DP rank, micro-batch, row).

Every rank runs the same planner over the same metadata (sample lengths, expected
densities), so every rank derives the same global plan without communication and then
reads only its own samples' tokens. Policies:
  - `sab` (default): sparsity-aware batching. A window of one step's token capacity is
    packed heaviest-predicted-first into the least-loaded micro-batch that can take each
    piece, local swaps/moves lower the heaviest micro-batch, then whole micro-batches are
    dealt to ranks to balance the ranks' sums. Loads are predicted latencies (cost model
    at each document's expected density).
  - `tokens`: the same machinery balancing token counts only (length-based packers).
  - `sequential`: pack in data order (the common baseline).
See docs/data.md for the algorithm, its complexity and the packing benchmark.
"""

from __future__ import annotations

import heapq
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

POLICIES = ("sab", "tokens", "sequential")
LONG_DOC_MODES = ("split", "truncate", "drop")
REWIND_STEPS = 256  # how far back a restored state may re-plan with exact observations
SEARCH_TARGETS = 4  # lightest micro-batches / ranks searched per move (on longtail-v1,
# 2 to 16 reach the same balance; more costs time)
ITER_FACTOR = 4  # at most ITER_FACTOR x (micro-batches or ranks) + 32 moves per search
BALANCE_TOL = 1e-3  # a search stops once the heaviest is this close to the mean: finer
# balance is below what any latency prediction can resolve


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


@dataclass(kw_only=True, slots=True)
class SABConfig:
    policy: str = "sab"
    """Packing policy: one of POLICIES."""
    long_docs: str = "split"
    """Documents longer than a row: `split` into row-sized chunks, `truncate`, or `drop`."""
    shuffle: bool = True
    """Visit samples in a seeded random order each epoch (else in id order)."""
    seed: int = 0
    max_tokens: int | None = None
    """Token cap per micro-batch; default (None) rows x seq_len, which is also the maximum."""
    observe_lag: int = 8
    """Observed densities from step s shape plans from step s + observe_lag on. Must exceed
    how far the loader plans ahead, so every rank applies them at the same step."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"sab.policy: unknown policy {self.policy!r}; expected one of {POLICIES}"
            )
        if self.long_docs not in LONG_DOC_MODES:
            raise ValueError(
                f"sab.long_docs: unknown mode {self.long_docs!r}; expected one of {LONG_DOC_MODES}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"sab.max_tokens: must be >= 1 (got {self.max_tokens})")
        if self.observe_lag < 1:
            raise ValueError(f"sab.observe_lag: must be >= 1 (got {self.observe_lag})")


CostFn = Callable[[Sequence[int], Sequence[float]], float]
"""Predicted latency (seconds) of one micro-batch from its document lengths and their
expected attention densities. The planner assumes it is additive over documents plus a
per-micro-batch constant `cost_fn([], [])` (true of linear + attention cost models).
Optionally the callable also offers `per_document(lengths, densities) -> ndarray`, the
marginal cost of each document alone, vectorised: the planner then prices a window in
one call instead of one call per piece."""

DensityPrior = Callable[[int], float]
"""Expected density of a document of a given length before it was ever observed."""


def as_cost_fn(fn: Callable[..., float]) -> CostFn:
    """Accept a lengths-only cost function `fn(doc_lens)` as a density-blind CostFn."""
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if len(params) == 1 and params[0].kind != params[0].VAR_POSITIONAL:
        return lambda doc_lens, densities: fn(doc_lens)
    return fn


@dataclass(frozen=True, slots=True)
class AnalyticCost:
    """CostFn: linear part ∝ tokens plus attention ∝ Σ density·len², in units of one
    token's linear cost, calibrated so attention is `attention_share` of the cost of a
    row holding one `row_len`-token document. A stated stand-in for a measured profile."""

    row_len: int
    attention_share: float = 0.6

    def __post_init__(self) -> None:
        if not 0.0 <= self.attention_share < 1.0 or self.row_len < 1:
            raise ValueError(
                f"AnalyticCost: need row_len >= 1 and attention_share in [0, 1) "
                f"(got {self.row_len}, {self.attention_share})"
            )

    @property
    def quad(self) -> float:
        return self.attention_share / (1.0 - self.attention_share) / self.row_len

    def __call__(self, doc_lens: Sequence[int], densities: Sequence[float]) -> float:
        q = self.quad
        return float(sum(doc_lens)) + q * sum(
            r * n * n for n, r in zip(doc_lens, densities, strict=True)
        )

    def per_document(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        """Vectorised marginal cost of each document alone (the planner's fast path)."""
        n = lengths.astype(np.float64)
        return n + self.quad * (densities * n * n)  # same rounding as __call__


@dataclass(slots=True)
class _Observed:
    """One `observe` call: densities of `ids`, visible from planner step `at_step`."""

    at_step: int
    ids: np.ndarray  # int64, unique
    values: np.ndarray  # float32
    previous: np.ndarray | None = None  # what they overwrote; None while not yet applied


class DensityStore:
    """Observed densities by sample id, made visible at a fixed planner step.

    The trainer reports densities some steps after the loader planned ahead, at a time
    that differs between ranks; tying each observation to the step it takes effect
    (`at_step`) keeps every rank's plans identical. Applied entries keep the values they
    overwrote for REWIND_STEPS steps, so a restored, older planner state re-plans exactly.
    """

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self.values: np.ndarray | None = None  # float32, NaN = never observed
        self.log: list[_Observed] = []
        self.applied_through = -1  # entries with at_step <= this are in `values`
        self.pruned_through = -1  # entries up to here were forgotten (no rewind before)

    def add(self, at_step: int, ids: np.ndarray, values: np.ndarray) -> None:
        if at_step <= self.applied_through:
            raise RuntimeError(
                f"sab: densities for step {at_step} arrived after that step was planned "
                f"(planned through {self.applied_through}); raise sab.observe_lag"
            )
        if self.log and at_step < self.log[-1].at_step:
            raise ValueError(
                f"sab: observations must come in step order ({at_step} after "
                f"{self.log[-1].at_step})"
            )
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise ValueError(f"sab: observed sample id out of range [0, {self.num_samples})")
        if not np.all((values > 0) & (values <= 1)):
            raise ValueError("sab: observed densities must lie in (0, 1]")
        ids, last = np.unique(ids[::-1], return_index=True)  # a repeated id: last one wins
        self.log.append(_Observed(at_step, ids, values[::-1][last].astype(np.float32)))

    def visible_at(self, step: int) -> None:
        """Show exactly the entries with at_step <= step (hide later ones a restored,
        older planner state must not see yet; apply earlier ones not applied yet)."""
        self._rewind(step)
        for e in self.log:
            if e.previous is None and e.at_step <= step:
                if self.values is None:
                    self.values = np.full(self.num_samples, np.nan, dtype=np.float32)
                e.previous = self.values[e.ids]
                self.values[e.ids] = e.values
        self.applied_through = max(self.applied_through, step)
        while self.log and self.log[0].previous is not None:
            if self.log[0].at_step >= step - REWIND_STEPS:
                break
            self.pruned_through = self.log.pop(0).at_step

    def _rewind(self, step: int) -> None:
        if step < self.pruned_through:
            raise ValueError(
                f"sab: cannot restore planner step {step + 1}: observations up to step "
                f"{self.pruned_through} were already folded in"
            )
        for e in reversed(self.log):
            if e.previous is not None and e.at_step > step:
                self.values[e.ids] = e.previous
                e.previous = None
        self.applied_through = min(self.applied_through, step)

    def lookup(self, ids: Sequence[int]) -> np.ndarray:
        """Visible observed densities of `ids` (NaN where never observed)."""
        if self.values is None:
            return np.full(len(ids), np.nan, dtype=np.float32)
        return self.values[np.asarray(ids, dtype=np.int64)]

    def state_dict(self) -> dict:
        return {
            "values": None if self.values is None else self.values.copy(),
            "log": [
                {"at_step": e.at_step, "ids": e.ids, "values": e.values, "previous": e.previous}
                for e in self.log  # entry arrays are never modified in place: no copies
            ],
            "applied_through": self.applied_through,
            "pruned_through": self.pruned_through,
        }

    def load_state_dict(self, state: dict) -> None:
        values = state["values"]
        if values is not None and len(values) != self.num_samples:
            raise ValueError(
                f"sab: checkpointed densities cover {len(values)} samples, the dataset has "
                f"{self.num_samples}"
            )
        self.values = None if values is None else np.array(values, dtype=np.float32)
        self.log = [_Observed(**e) for e in state["log"]]
        self.applied_through = state["applied_through"]
        self.pruned_through = state["pruned_through"]


@dataclass(slots=True)
class _State:
    epoch: int = 0
    cursor: int = 0  # next position in the epoch's sample order
    step: int = 0
    pending: list[Piece] = field(default_factory=list)  # pieces carried to the next step
    dropped: int = 0  # samples dropped under long_docs="drop" (counted, logged)


class Planner:
    """Deterministic, resumable global step planner.

    State is (epoch, cursor, carried-over pieces, step, dropped count, observed
    densities); a restored planner produces exactly the steps the original would have
    produced next. `observe` must be fed identically on every rank (the trainer
    all-gathers the densities); `next_step` may run in a prefetch thread.
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
        cost_fn: CostFn | Callable[[Sequence[int]], float],
        density_prior: DensityPrior | None = None,
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
        self.max_tokens = config.max_tokens or rows_per_microbatch * seq_len
        if self.max_tokens > rows_per_microbatch * seq_len:
            raise ValueError(
                f"sab.max_tokens={self.max_tokens} exceeds a micro-batch's "
                f"{rows_per_microbatch} x {seq_len} tokens"
            )
        self.piece_len = min(seq_len, self.max_tokens)  # longest piece that fits anywhere
        if self.lengths.max() <= 0 or (
            config.long_docs == "drop"
            and not np.any((self.lengths > 0) & (self.lengths <= self.piece_len))
        ):
            raise ValueError(
                f"Planner: no sample yields tokens (long_docs={config.long_docs!r}, "
                f"longest piece {self.piece_len})"
            )
        self.cost_fn = as_cost_fn(cost_fn)
        self.base_cost = float(self.cost_fn([], []))
        self.density_prior = density_prior
        self._lens_list = self.lengths.tolist()
        cap = self.piece_len
        if config.long_docs == "split":
            self._yields = self.lengths  # tokens each sample contributes to a window
        elif config.long_docs == "truncate":
            self._yields = np.minimum(self.lengths, cap)
        else:
            self._yields = np.where(self.lengths > cap, 0, self.lengths)
        self._mean_yield = max(float(self._yields.mean()), 1.0)
        self.state = _State()
        self.densities = DensityStore(len(self.lengths))
        self._lock = threading.Lock()
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def dropped(self) -> int:
        return self.state.dropped

    # -- sample order -------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        n = len(self.lengths)
        if self.config.shuffle:
            order = np.random.default_rng([self.config.seed, epoch]).permutation(n)
        else:
            order = np.arange(n)
        self._order_cache = (epoch, order)
        return order

    def pieces_of(self, sample_id: int) -> list[Piece]:
        """Split a sample into row-sized pieces (or truncate/drop it)."""
        n = self._lens_list[sample_id]
        cap = self.piece_len
        if n <= cap:
            return [Piece(sample_id, 0, n)] if n > 0 else []
        mode = self.config.long_docs
        if mode == "drop":
            self.state.dropped += 1
            d = self.state.dropped
            if d & (d - 1) == 0:  # log the 1st, 2nd, 4th, ... drop
                logger.warning(
                    "sab: dropped sample %d (%d tokens > %d per piece); %d dropped so far",
                    sample_id,
                    n,
                    cap,
                    d,
                )
            return []
        if mode == "truncate":
            return [Piece(sample_id, 0, cap)]
        return [Piece(sample_id, s, min(cap, n - s)) for s in range(0, n, cap)]

    def _next_sample(self) -> int:
        st = self.state
        order = self.epoch_order(st.epoch)
        while st.cursor >= len(order):
            st.epoch += 1
            st.cursor = 0
            order = self.epoch_order(st.epoch)
        st.cursor += 1
        return int(order[st.cursor - 1])

    def _next_piece(self) -> Piece:
        st = self.state
        while not st.pending:
            st.pending.extend(self.pieces_of(self._next_sample()))
        return st.pending.pop(0)

    # -- densities ------------------------------------------------------------------
    def observe(self, sample_ids: Sequence[int], densities: Sequence[float], step: int) -> None:
        """Densities measured while training the plan with `StepPlan.step == step`.

        They shape plans from step `step + sab.observe_lag` on. Call it with the same
        arguments on every rank (all-gather the measurements first).
        """
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        values = np.asarray(densities, dtype=np.float64).reshape(-1)
        if len(ids) != len(values):
            raise ValueError(f"observe: {len(ids)} sample ids but {len(values)} densities")
        with self._lock:
            self.densities.add(step + self.config.observe_lag, ids, values)

    def expected_densities(self, pieces: Sequence[Piece]) -> list[float]:
        """Last observed density of each piece's sample, else the prior at its length."""
        seen = self.densities.lookup([p.sample_id for p in pieces]).astype(np.float64)
        unseen = np.flatnonzero(np.isnan(seen))
        if self.density_prior is None:
            seen[unseen] = 1.0
        else:
            prior = self.density_prior
            seen[unseen] = [prior(pieces[i].length) for i in unseen.tolist()]
        return seen.tolist()

    # -- planning -----------------------------------------------------------------
    def next_step(self) -> StepPlan:
        with self._lock:
            self.densities.visible_at(self.state.step)
            epoch = self.state.epoch
            if self.config.policy == "sequential":
                bins = self._plan_sequential()
                dens = [self.expected_densities([p for row in rows for p in row]) for rows in bins]
            else:
                bins, dens = self._plan_balanced()
            plan = self._assemble(bins, dens, epoch)
            self.state.step += 1
            return plan

    def _plan_sequential(self) -> list[list[list[Piece]]]:
        """Fill rows in data order; a piece that does not fit starts the next row."""
        bins = []
        for _ in range(self.dp * self.microbatches):
            rows: list[list[Piece]] = [[] for _ in range(self.rows)]
            row = used = mb_used = 0
            while True:
                piece = self._next_piece()
                if used + piece.length > self.seq_len:
                    row, used = row + 1, 0
                if row == self.rows or mb_used + piece.length > self.max_tokens:
                    self.state.pending.insert(0, piece)
                    break
                rows[row].append(piece)
                used += piece.length
                mb_used += piece.length
            bins.append(rows)
        return bins

    def _plan_balanced(self) -> tuple[list[list[list[Piece]]], list[list[float]]]:
        """`sab` / `tokens`: window → pack micro-batches → deal them to ranks.

        Pieces carried over from the last step are placed first, so none waits long;
        what still does not fit is carried to the next step (nothing dropped or repeated).
        """
        n_bins = self.dp * self.microbatches
        window, n_carried = self._fill_window(n_bins * self.max_tokens)
        lens = np.fromiter((p.length for p in window), dtype=np.int64, count=len(window))
        dens = self.expected_densities(window)
        per_document = getattr(self.cost_fn, "per_document", None)
        if self.config.policy == "tokens":
            cost = lens.astype(np.float64)
        elif per_document is not None:
            cost = np.asarray(per_document(lens, np.asarray(dens)), dtype=np.float64)
        else:
            cost_fn, base = self.cost_fn, self.base_cost
            cost = np.array(
                [cost_fn([p.length], [r]) - base for p, r in zip(window, dens, strict=True)]
            )
        ids = np.fromiter((p.sample_id for p in window), dtype=np.int64, count=len(window))
        starts = np.fromiter((p.start for p in window), dtype=np.int64, count=len(window))
        carried = np.arange(len(window)) >= n_carried  # False (first) for carried pieces
        order = np.lexsort((starts, ids, -cost, carried))
        pack = _Packing(self, lens, cost)
        pack.greedy(order)
        pack.improve()
        deal = pack.deal()
        placed = pack.row >= 0
        self.state.pending = [window[i] for i in range(len(window)) if not placed[i]]
        return pack.bins(window, dens, order, deal)

    def _fill_window(self, capacity: int) -> tuple[list[Piece], int]:
        """Carried-over pieces first, then samples in epoch order, up to `capacity` tokens."""
        st = self.state
        window, st.pending = st.pending, []
        n_carried = len(window)
        need = capacity - sum(p.length for p in window)
        while need > 0:
            order = self.epoch_order(st.epoch)
            if st.cursor >= len(order):
                st.epoch, st.cursor = st.epoch + 1, 0
                continue
            chunk = order[st.cursor : st.cursor + 2 * int(need / self._mean_yield) + 64]
            got = np.cumsum(self._yields[chunk])
            k = min(int(np.searchsorted(got, need)) + 1, len(chunk))
            lens, cap = self._lens_list, self.piece_len
            for sample_id in chunk[:k].tolist():
                n = lens[sample_id]
                if 0 < n <= cap:  # the common case, inlined
                    window.append(Piece(sample_id, 0, n))
                else:
                    window.extend(self.pieces_of(sample_id))
            st.cursor += k
            need -= int(got[k - 1])
        return window, n_carried

    def _assemble(
        self, bins: list[list[list[Piece]]], dens: list[list[float]], epoch: int
    ) -> StepPlan:
        """Rank-major bins → micro-batches, each with its densities and predicted latency."""
        mbs = []
        for r in range(self.dp):
            rank_mbs = []
            for b in range(r * self.microbatches, (r + 1) * self.microbatches):
                mb = MicroBatchPlan(rows=bins[b], densities=dens[b])
                mb.predicted_s = float(self.cost_fn(mb.doc_lens, dens[b]))
                rank_mbs.append(mb)
            mbs.append(rank_mbs)
        return StepPlan(step=self.state.step, epoch=epoch, microbatches=mbs)

    # -- checkpointing --------------------------------------------------------------
    def state_dict(self, observations: bool = True) -> dict:
        """Everything a restored planner needs; `observations=False` leaves the density
        store out (cheap, for per-item snapshots when the store is saved separately)."""
        with self._lock:
            st = self.state
            state = {
                "epoch": st.epoch,
                "cursor": st.cursor,
                "step": st.step,
                "pending": [[p.sample_id, p.start, p.length] for p in st.pending],
                "dropped": st.dropped,
                "policy": self.config.policy,
                "seed": self.config.seed,
            }
            if observations:
                state["observations"] = self.densities.state_dict()
            return state

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.config.seed:
            raise ValueError(
                f"data loader checkpoint was made with sab.seed={state['seed']}, "
                f"but the config has sab.seed={self.config.seed}"
            )
        with self._lock:
            self.state = _State(
                epoch=state["epoch"],
                cursor=state["cursor"],
                step=state["step"],
                pending=[Piece(*p) for p in state["pending"]],
                dropped=state["dropped"],
            )
            if "observations" in state:
                self.densities.load_state_dict(state["observations"])

    def observation_state(self) -> dict:
        """The density store alone (checkpoint it live, beside per-item snapshots)."""
        with self._lock:
            return self.densities.state_dict()

    def load_observation_state(self, state: dict) -> None:
        """Restore a live density store; it may run ahead of the planner state (restored
        before or after it): the next step shows only what that step may see."""
        with self._lock:
            self.densities.load_state_dict(state)


class _Packing:
    """A window's pieces packed into micro-batches, which are then dealt to ranks.

    The two levels of the objective separate: packing decides every micro-batch's load
    (minimise the heaviest micro-batch), dealing decides only which rank runs which
    micro-batch (minimise the heaviest rank sum). Dealing exchanges whole micro-batches,
    which is always token-feasible; moving single pieces between ranks rarely is once
    rows are full.

    Rows are numbered flat, `b * rows + w` for micro-batch b (packing order, not rank
    order); a piece's row is -1 while unplaced (carried to the next step).
    """

    def __init__(self, planner: Planner, lens: np.ndarray, cost: np.ndarray) -> None:
        self.dp, self.mbs, self.nrows = planner.dp, planner.microbatches, planner.rows
        self.n_mbs = self.dp * self.mbs
        self.seq_len, self.max_tokens = planner.seq_len, planner.max_tokens
        self.lens, self.cost = lens, cost
        self.row = np.full(len(lens), -1, dtype=np.int64)

    # -- packing ------------------------------------------------------------------------
    def greedy(self, order: np.ndarray) -> None:
        """Pieces in `order` (heaviest first) into the least-loaded micro-batch that can
        take them (token cap, and a row with room), first-fit into its rows.

        Micro-batches sit in a min-heap by load; one too full for the current piece is
        parked in a max-heap by the longest piece it still takes and returns once pieces
        get that short (they mostly shrink along the order), so each is set aside about
        once: O(n log B) for n pieces and B micro-batches.
        """
        nw = self.nrows
        lens, cost = self.lens.tolist(), self.cost.tolist()
        fit0 = min(self.seq_len, self.max_tokens)
        row_free = [[self.seq_len] * nw for _ in range(self.n_mbs)]
        mb_free = [self.max_tokens] * self.n_mbs
        mb_fit = [fit0] * self.n_mbs  # longest piece the micro-batch still takes
        mb_load = [0.0] * self.n_mbs
        version = [0] * self.n_mbs  # a heap entry is live only while its version is current
        heap = [(0.0, b, 0) for b in range(self.n_mbs)]  # (load, micro-batch, version)
        parked: list[tuple[int, int, int]] = []  # (-fit, micro-batch, version)
        placed = [-1] * len(lens)
        pop, push = heapq.heappop, heapq.heappush
        for i in order.tolist():
            n = lens[i]
            while parked and -parked[0][0] >= n:
                _, cand, ver = pop(parked)
                push(heap, (mb_load[cand], cand, ver))
            b = -1
            while heap:
                _, cand, ver = heap[0]
                if ver != version[cand]:
                    pop(heap)
                elif mb_fit[cand] >= n:
                    b = cand
                    break
                else:
                    pop(heap)
                    push(parked, (-mb_fit[cand], cand, ver))
            if b < 0:
                continue  # fits nowhere: carried over
            free = row_free[b]
            j = 0
            while free[j] < n:
                j += 1
            free[j] -= n
            mb_free[b] -= n
            mb_fit[b] = min(mb_free[b], max(free))
            mb_load[b] += cost[i]
            placed[i] = b * nw + j
            version[b] += 1
            push(heap, (mb_load[b], b, version[b]))
        self.row = np.array(placed, dtype=np.int64)
        placed_mask = self.row >= 0
        rows = self.row[placed_mask]
        n_rows = self.n_mbs * nw
        used = np.bincount(rows, weights=self.lens[placed_mask], minlength=n_rows)
        self.row_used = used.astype(np.int64)
        self.mb_tok = self.row_used.reshape(-1, nw).sum(1)
        self.mb_load = np.bincount(rows // nw, weights=self.cost[placed_mask], minlength=self.n_mbs)

    def improve(self) -> None:
        """Swaps/moves of pieces off the heaviest micro-batch, to the SEARCH_TARGETS
        lightest, one best move at a time, while the heaviest falls."""
        members = np.flatnonzero(self.row >= 0)
        is_target = np.zeros(self.n_mbs, dtype=bool)
        local_rows = np.arange(self.nrows)
        loads = self.mb_load
        for _ in range(ITER_FACTOR * self.n_mbs + 32):
            heavy = int(np.argmax(loads))
            if loads[heavy] * self.n_mbs <= loads.sum() * (1.0 + BALANCE_TOL):
                return
            mb_of = self.row[members] // self.nrows
            src = members[mb_of == heavy]
            if len(src) < 2:
                return  # a lone piece cannot shrink its micro-batch: the bound is reached
            lights = np.argsort(loads, kind="stable")
            lights = lights[lights != heavy][:SEARCH_TARGETS]
            is_target[:] = False
            is_target[lights] = True
            dst = members[is_target[mb_of]]
            slots = (lights[:, None] * self.nrows + local_rows).ravel()
            move = self._best_swap(src, dst, slots, heavy)
            if move is None:
                return
            self._apply(*move)

    def _room(self, rows: np.ndarray) -> np.ndarray:
        """Tokens a row could still take (its own space and its micro-batch's cap)."""
        mb_room = self.max_tokens - self.mb_tok[rows // self.nrows]
        return np.minimum(self.seq_len - self.row_used[rows], mb_room)

    def _best_swap(
        self, src: np.ndarray, dst: np.ndarray, slots: np.ndarray, heavy: int
    ) -> tuple[int, int, int] | None:
        """Best exchange of a piece of the heavy micro-batch with a destination piece or
        an empty slot of a destination row (a move): the one that leaves the pair's
        larger load smallest, if that is below the heavy micro-batch's load.

        Only length-compatible pairs are formed (q no longer than p plus p's spare room,
        found by binary search), so full rows cost O((|src| + pairs) log |dst|).
        """
        loads, nw = self.mb_load, self.nrows
        top = float(loads[heavy])
        eps = 1e-9 * max(abs(top), 1e-30)
        n_dst = len(dst)
        lq = np.concatenate([self.lens[dst], np.zeros(len(slots), np.int64)])
        cq = np.concatenate([self.cost[dst], np.zeros(len(slots))])
        rq = np.concatenate([self.row[dst], slots])
        room_q = self._room(rq)
        by_len = np.argsort(lq, kind="stable")
        lq_sorted = lq[by_len]
        lp, rp = self.lens[src], self.row[src]
        room_p = self._room(rp)
        lo = np.searchsorted(lq_sorted, lp - room_q.max(), side="left")
        hi = np.searchsorted(lq_sorted, lp + room_p, side="right")
        counts = np.maximum(hi - lo, 0)
        total = int(counts.sum())
        if total == 0:
            return None
        a = np.repeat(np.arange(len(src)), counts)
        starts = np.repeat(lo - np.cumsum(counts) + counts, counts)
        b = by_len[starts + np.arange(total)]
        dl = lp[a] - lq[b]
        ok = dl <= room_q[b]  # p fits where q was (and q, shorter by -dl, where p was)
        d = self.cost[src[a]] - cq[b]
        after = loads[rq[b] // nw] + d
        ok &= (d > eps) & (after < top - eps)
        score = np.where(ok, np.maximum(top - d, after), np.inf)
        k = int(np.argmin(score))  # ties: first pair (source order, then shorter q)
        if not np.isfinite(score[k]):
            return None
        q = int(dst[b[k]]) if b[k] < n_dst else -1  # -1: a move into an empty slot
        return int(src[a[k]]), q, int(rq[b[k]])

    def _apply(self, p: int, q: int, to_row: int) -> None:
        from_row = int(self.row[p])
        self._shift(p, from_row, to_row)
        if q >= 0:
            self._shift(q, to_row, from_row)

    def _shift(self, i: int, a: int, b: int) -> None:
        n, c = int(self.lens[i]), float(self.cost[i])
        self.row_used[a] -= n
        self.row_used[b] += n
        self.mb_tok[a // self.nrows] -= n
        self.mb_tok[b // self.nrows] += n
        self.mb_load[a // self.nrows] -= c
        self.mb_load[b // self.nrows] += c
        self.row[i] = b

    # -- dealing ------------------------------------------------------------------------
    def deal(self) -> np.ndarray:
        """[dp, m] micro-batch ids per rank: heaviest first to the lightest rank with
        room (m each), then exchanges between the heaviest rank and the SEARCH_TARGETS
        lightest while the heaviest rank sum falls. O(B log dp + iterations · m²)."""
        dp, m, loads = self.dp, self.mbs, self.mb_load
        heap = [(0.0, r) for r in range(dp)]
        groups: list[list[int]] = [[] for _ in range(dp)]
        for b in np.lexsort((np.arange(self.n_mbs), -loads)).tolist():  # ties: by id
            total, r = heapq.heappop(heap)
            groups[r].append(b)
            if len(groups[r]) < m:
                heapq.heappush(heap, (total + float(loads[b]), r))
        deal = np.array(groups, dtype=np.int64)
        if dp > 1 and m > 1:
            for _ in range(ITER_FACTOR * dp + 32):
                if not self._exchange(deal):
                    break
        deal.sort(axis=1)  # a rank runs its micro-batches in packing order
        return deal

    def _exchange(self, deal: np.ndarray) -> bool:
        """One best micro-batch exchange off the heaviest rank; False if none helps."""
        sums = self.mb_load[deal].sum(1)
        heavy = int(np.argmax(sums))
        top = float(sums[heavy])
        if top * len(sums) <= sums.sum() * (1.0 + BALANCE_TOL):
            return False
        lights = np.argsort(sums, kind="stable")
        lights = lights[lights != heavy][:SEARCH_TARGETS]
        d = self.mb_load[deal[heavy]][None, :, None] - self.mb_load[deal[lights]][:, None, :]
        after = sums[lights][:, None, None] + d
        eps = 1e-9 * max(abs(top), 1e-30)
        ok = (d > eps) & (after < top - eps)
        score = np.where(ok, np.maximum(top - d, after), np.inf)
        k = int(np.argmin(score))
        if not np.isfinite(score.flat[k]):
            return False
        t, x, y = np.unravel_index(k, score.shape)
        light = int(lights[t])
        deal[heavy, x], deal[light, y] = deal[light, y], deal[heavy, x]
        return True

    def bins(
        self, window: list[Piece], dens: list[float], order: np.ndarray, deal: np.ndarray
    ) -> tuple[list[list[list[Piece]]], list[list[float]]]:
        """Rank-major micro-batches (rank r's j-th is `deal[r, j]`): pieces per row in
        greedy order, and each micro-batch's densities in the same (row-major) order."""
        nw = self.nrows
        pieces: list[list[Piece]] = [[] for _ in range(self.n_mbs * nw)]
        row_dens: list[list[float]] = [[] for _ in range(self.n_mbs * nw)]
        rows = self.row.tolist()
        for i in order.tolist():
            if rows[i] >= 0:
                pieces[rows[i]].append(window[i])
                row_dens[rows[i]].append(dens[i])
        ids = deal.reshape(-1).tolist()
        out = [pieces[b * nw : (b + 1) * nw] for b in ids]
        out_dens = [sum(row_dens[b * nw : (b + 1) * nw], []) for b in ids]
        return out, out_dens


# -- statistics -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PlanStats:
    """How balanced one step's plan is under the planner's cost model (predicted)."""

    rank_imbalance: float  # max / mean of ranks' summed micro-batch latency
    microbatch_imbalance: float  # max / mean over all micro-batches of the step
    microbatch_bound: float  # max(heaviest single piece, mean) / mean: packing's floor
    padding: float  # share of the step's row tokens left empty
    pieces: int
    tokens: int


def plan_stats(plan: StepPlan, seq_len: int, cost_fn: CostFn) -> PlanStats:
    """Predicted imbalance of a plan; the bound is what no placement can beat."""
    cost_fn = as_cost_fn(cost_fn)
    mbs = [mb for rank in plan.microbatches for mb in rank]
    loads = np.array([[mb.predicted_s for mb in rank] for rank in plan.microbatches])
    base = float(cost_fn([], []))
    heaviest = (
        max(
            (
                cost_fn([n], [r]) - base
                for mb in mbs
                for n, r in zip(mb.doc_lens, mb.densities or [1.0] * len(mb.doc_lens), strict=True)
            ),
            default=0.0,
        )
        + base
    )
    mean_mb = float(loads.mean())
    ranks = loads.sum(axis=1)
    tokens = sum(mb.num_tokens for mb in mbs)
    row_tokens = sum(len(mb.rows) for mb in mbs) * seq_len
    safe = mean_mb if mean_mb > 0 else 1.0
    return PlanStats(
        rank_imbalance=float(ranks.max() / ranks.mean()) if ranks.mean() > 0 else 1.0,
        microbatch_imbalance=float(loads.max()) / safe,
        microbatch_bound=max(heaviest, mean_mb) / safe,
        padding=1.0 - tokens / row_tokens,
        pieces=sum(len(mb.doc_lens) for mb in mbs),
        tokens=tokens,
    )


def summarize(stats: Sequence[PlanStats]) -> dict[str, float]:
    """Mean of each ratio over steps (the figures sb-plan and the packing bench report)."""
    keys = ("rank_imbalance", "microbatch_imbalance", "microbatch_bound", "padding")
    out = {k: float(np.mean([getattr(s, k) for s in stats])) for k in keys}
    out["pieces_per_step"] = float(np.mean([s.pieces for s in stats]))
    return out
