"""The SAB planner: one global plan per step from sample metadata, deterministic on
every rank (docs/data.md)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sb_titan.balance.sab.config import SABConfig
from sb_titan.balance.sab.cost import CostFn, DensityPrior, as_cost_fn
from sb_titan.balance.sab.density_store import DensityStore
from sb_titan.balance.sab.packing import Packing, PackingShape
from sb_titan.balance.sab.plan import MicroBatchPlan, Piece, StepPlan
from sb_titan.util.repeats import is_shown

logger = logging.getLogger(__name__)


"""Predicted latency (seconds) of one micro-batch from its document lengths and their
expected attention densities. The planner assumes it is additive over documents plus a
per-micro-batch constant `cost_fn([], [])` (true of linear + attention cost models).
Optionally the callable also offers `per_document(lengths, densities) -> ndarray`, the
marginal cost of each document alone, vectorised: the planner then prices a window in
one call instead of one call per piece."""


"""Expected density of a document of a given length before it was ever observed."""


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
        self.cost_fn: CostFn = as_cost_fn(cost_fn)
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
        self.recalls = DensityStore(len(self.lengths), columns=3)  # see observe_recalls
        self._lock = threading.Lock()
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def dropped(self) -> int:
        return self.state.dropped

    def price_with(
        self, cost_fn: CostFn | Callable[[Sequence[int]], float], density_prior: DensityPrior | None
    ) -> None:
        """Price the next steps with another cost model (the loader swaps in the lagged
        cost-model snapshot before every step; balance/snapshots.py)."""
        with self._lock:
            self.cost_fn = as_cost_fn(cost_fn)
            self.base_cost = float(self.cost_fn([], []))
            self.density_prior = density_prior

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
            if is_shown(d):  # log the 1st, 2nd, 4th, ... drop
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

    def observe_recalls(self, sample_ids: Sequence[int], values: np.ndarray, step: int) -> None:
        """Recall measured per document while training the plan of step `step`: rows of
        (budget, kept mass of its budget-sensitive tokens, weight of the measurement in
        (0, 1)), each in (0, 1]. Plans from step `step + sab.observe_lag` on carry them
        (MicroBatchPlan.recalls), as they carry densities."""
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        with self._lock:
            self.recalls.add(step + self.config.observe_lag, ids, np.asarray(values))

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
            self.recalls.visible_at(self.state.step)
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
        shape = PackingShape(self.dp, self.microbatches, self.rows, self.seq_len, self.max_tokens)
        pack = Packing(shape, lens, cost)
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
                if self.recalls.values is not None:  # any document's measured recall
                    ids = [p.sample_id for row in bins[b] for p in row]
                    mb.recalls = self.recalls.lookup(ids).astype(np.float64).tolist()
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
                state["observations"] = self._observation_state()
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
                self._load_observation_state(state["observations"])

    def observation_state(self) -> dict:
        """The observation stores: densities, and per-document recalls under "recalls"
        (checkpoint them live, beside per-item snapshots)."""
        with self._lock:
            return self._observation_state()

    def load_observation_state(self, state: dict) -> None:
        """Restore live observation stores; they may run ahead of the planner state (restored
        before or after it): the next step shows only what that step may see."""
        with self._lock:
            self._load_observation_state(state)

    def _observation_state(self) -> dict:
        return {**self.densities.state_dict(), "recalls": self.recalls.state_dict()}

    def _load_observation_state(self, state: dict) -> None:
        """The density store's keys, and the recall store's under "recalls" (absent in
        checkpoints written before per-document recall: none observed yet)."""
        self.densities.load_state_dict(state)
        self.recalls = DensityStore(self.recalls.num_samples, columns=3)
        if "recalls" in state:
            self.recalls.load_state_dict(state["recalls"])
