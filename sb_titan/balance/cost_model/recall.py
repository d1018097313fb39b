"""RecallModel: the estimated attention mass budget-sensitive query tokens keep.

A query token past the first two blocks of its document keeps at least beta of its
estimated mass under both selection policies (`mass` stops once it has beta; the top
ceil(beta * n) blocks by mass hold at least beta of it). What it keeps beyond beta, the
overshoot, comes from granularity: whole blocks are kept, at least two of them (sink
and diagonal), out of the n a query block may see. So the prior is what uniform mass
would give, max(ceil(beta * n), 2) / n - beta averaged over the document's sensitive
query blocks (n = 3 .. N for a document of N blocks): large for short documents, small
for long ones. On top of it one correction per integer log2-length knot is learned
from measured recall at *any* budget (DST moves budgets away from beta0 exactly when it
acts, and a model that learned per budget would mispredict beta0 itself):

    r(beta, L) = min(1, beta + uniform_overshoot(beta, L) + correction(L))

DST (dst.py) predicts a step's recall with it; the trainer feeds it what it measures.

With `beta_knots` > 0 (`[dst] recall_by_budget`) the correction is also learned per
budget knot (k / beta_knots) within each length knot, linear between knots and between
a length's observed budgets: measured curves rise with
the budget at a slope that differs with length (bench/recall_curves.py: from beta 0.5 to
0.9, +0.04 at 1K tokens, +0.32 at 64K), which one constant per length cannot follow, and
per-document budgets trade recall exactly across lengths. Observed at one budget only,
it predicts what the per-length correction predicts.

`measure="true"` models true recall instead (attention/recall.py: the exact mass of
sampled queries that the kept blocks cover), and `measure="top_key"` the top-key hit
rate (the share of sampled queries whose key of greatest true probability was kept).
Neither need reach beta (the estimator can misjudge blocks): the same prior and
per-length correction, with the floor at 0 instead of beta, so the correction learns the
estimator's gap (negative where it overstates) as well as the granularity overshoot.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal, get_args

import numpy as np

from sb_titan.balance.cost_model.knot_means import fold_in, nearest, tables_from_state

_BETA_GRID = 200  # the prior is tabulated at beta = k / 200 and interpolated
RecallMeasure = Literal["top_key", "true", "estimated"]
RECALL_MEASURES: tuple[str, ...] = get_args(RecallMeasure)


def uniform_overshoot(beta: float, n_blocks: int) -> float:
    """Mean of max(ceil(beta * n), 2) / n - beta over n = 3 .. n_blocks (0 if none)."""
    n = np.arange(3, max(n_blocks, 2) + 1, dtype=np.float64)
    if not n.size:
        return 0.0
    kept = np.maximum(np.ceil(beta * n * (1 - 1e-9)), 2.0) / n
    return float(np.mean(np.minimum(kept, 1.0) - beta))


class RecallModel:
    """Kept mass of budget-sensitive tokens: uniform-mass prior + a learned correction."""

    def __init__(
        self,
        *,
        block_size: int = 64,
        log2_len_min: int = 6,
        log2_len_max: int = 20,
        max_count: int = 256,
        measure: RecallMeasure = "estimated",
        beta_knots: int = 0,
    ):
        if log2_len_max <= log2_len_min or max_count < 1 or block_size < 1 or beta_knots < 0:
            raise ValueError(
                "RecallModel: need log2_len_min < log2_len_max, max_count >= 1, "
                "block_size >= 1, beta_knots >= 0"
            )
        if measure not in RECALL_MEASURES:
            raise ValueError(f"RecallModel: measure {measure!r} is not one of {RECALL_MEASURES}")
        self.measure = measure
        self.block_size = int(block_size)
        self.log2_len_min, self.log2_len_max = int(log2_len_min), int(log2_len_max)
        self.max_count = int(max_count)
        knots = np.arange(self.log2_len_min, self.log2_len_max + 1)
        blocks = np.ceil(2.0**knots / self.block_size).astype(np.int64)
        betas = np.arange(_BETA_GRID + 1) / _BETA_GRID
        self._prior = np.array([[uniform_overshoot(b, n) for b in betas] for n in blocks])
        self.count = np.zeros(len(knots), dtype=np.int64)
        self.mean = np.zeros(len(knots), dtype=np.float64)
        self.beta_knots = int(beta_knots)
        # per (length knot, budget knot k / beta_knots): the same residuals, by budget too
        self.count_b = np.zeros((len(knots), self.beta_knots + 1), dtype=np.int64)
        self.mean_b = np.zeros((len(knots), self.beta_knots + 1), dtype=np.float64)
        self._refresh()

    def _refresh(self) -> None:
        """Unobserved knots take the nearest observed knot's correction (0 if none). By
        budget: an unobserved budget is linear between its length's observed budgets (the
        nearest one outside them), and an unobserved length takes its nearest observed
        length's row."""
        seen = np.flatnonzero(self.count > 0)
        if not seen.size:
            self.correction = np.zeros_like(self.mean)
            self.correction_b = np.zeros_like(self.mean_b)
            return
        self.correction = self.mean[nearest(seen, len(self.mean))]
        if self.beta_knots:
            rows = np.empty_like(self.mean_b)
            knots = np.arange(self.beta_knots + 1)
            for i in seen:  # a row without budget cells (a restored 1-D state): its mean
                cols = np.flatnonzero(self.count_b[i] > 0)
                rows[i] = (
                    np.interp(knots, cols, self.mean_b[i, cols]) if cols.size else self.mean[i]
                )
            self.correction_b = rows[nearest(seen, len(self.mean))]

    def _x(self, lengths: np.ndarray) -> np.ndarray:
        """Position on the log2-length knots."""
        x = np.log2(np.maximum(lengths, 1.0)) - self.log2_len_min
        return np.clip(x, 0.0, len(self.mean) - 1)

    def _uniform(self, beta: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The prior overshoot, bilinear in (log2 length, beta)."""
        x = self._x(lengths)
        i = np.minimum(np.floor(x).astype(np.int64), len(self.mean) - 2)
        y = np.clip(beta, 0.0, 1.0) * _BETA_GRID
        j = np.minimum(np.floor(y).astype(np.int64), _BETA_GRID - 1)
        u, v, p = x - i, y - j, self._prior
        return (1 - u) * ((1 - v) * p[i, j] + v * p[i, j + 1]) + u * (
            (1 - v) * p[i + 1, j] + v * p[i + 1, j + 1]
        )

    def _correction_rows(self, lengths: np.ndarray) -> np.ndarray:
        """The learned correction linear in log2 length: [D], or by budget each length's
        row over the budget knots [D, beta_knots + 1]."""
        x = self._x(lengths)
        i = np.minimum(np.floor(x).astype(np.int64), len(self.mean) - 2)
        table, u = (
            (self.correction_b, (x - i)[..., None]) if self.beta_knots else (self.correction, x - i)
        )
        return table[i] + u * (table[i + 1] - table[i])

    def _correction(self, lengths: np.ndarray, beta: np.ndarray) -> np.ndarray:
        """The learned correction at (length, budget)."""
        rows = self._correction_rows(lengths)
        return self._along_beta(rows, beta) if self.beta_knots else rows

    def _along_beta(self, rows: np.ndarray, beta: np.ndarray) -> np.ndarray:
        """rows [..., beta_knots + 1] at `beta` [...], linearly between budget knots."""
        y = np.clip(beta, 0.0, 1.0) * self.beta_knots
        j = np.minimum(np.floor(y).astype(np.int64), self.beta_knots - 1)[..., None]
        lo = np.take_along_axis(rows, j, axis=-1)[..., 0]
        hi = np.take_along_axis(rows, j + 1, axis=-1)[..., 0]
        return lo + (y - j[..., 0]) * (hi - lo)

    def _floor(self, beta: np.ndarray) -> np.ndarray | float:
        """Estimated kept mass never falls below beta; measured quantities can."""
        return beta if self.measure == "estimated" else 0.0

    def predict(self, beta: np.ndarray | float, lengths: np.ndarray | Sequence[int]) -> np.ndarray:
        """Kept mass per document, within [beta, 1] (estimated) or [0, 1] (true)."""
        beta, lengths = np.broadcast_arrays(
            np.asarray(beta, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
        )
        overshoot = self._uniform(beta, lengths) + self._correction(lengths, beta)
        return np.clip(beta + overshoot, self._floor(beta), 1.0)

    def length_rows(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flat prior offset of each length's lower knot, weight, correction) [D]: the
        budget-independent half of `predict`, done once per document (`predict_rows`).
        By budget, the correction is each document's row over the budget knots
        [D, beta_knots + 1]."""
        lengths = np.asarray(lengths, dtype=np.float64)
        x = self._x(lengths)
        i = np.minimum(np.floor(x).astype(np.int64), len(self.mean) - 2)
        return i * self._prior.shape[1], x - i, self._correction_rows(lengths)

    def predict_rows(
        self,
        rows: tuple[np.ndarray, np.ndarray, np.ndarray],
        beta: np.ndarray,
        index: np.ndarray | None = None,
    ) -> np.ndarray:
        """`predict` from `length_rows` at budget beta[index[d]] for document d (beta
        per document without index): the same arithmetic in the same order, so
        bit-identical to it."""
        base, u, correction = rows
        beta = np.asarray(beta, dtype=np.float64)
        y = np.clip(beta, 0.0, 1.0) * _BETA_GRID
        j = np.minimum(np.floor(y).astype(np.int64), _BETA_GRID - 1)
        v = y - j
        if index is not None:
            beta, j, v = beta[index], j[index], v[index]
        p, flat, up = self._prior.ravel(), base + j, base + self._prior.shape[1] + j
        uniform = (1 - u) * ((1 - v) * p[flat] + v * p[flat + 1]) + u * (
            (1 - v) * p[up] + v * p[up + 1]
        )
        if correction.ndim == 2:
            correction = self._along_beta(correction, beta)
        return np.clip(beta + (uniform + correction), self._floor(beta), 1.0)

    def update(self, observations: Iterable[tuple[float, int, float]]) -> None:
        """Fold in (beta, length, kept mass) triples: per knot, the mean of what was kept
        beyond the prior (exact up to max_count observations, then an EMA: attention
        sharpens as training goes)."""
        obs = np.asarray(list(observations), dtype=np.float64).reshape(-1, 3)
        beta, length, kept = obs.T
        ok = np.isfinite(obs).all(axis=1) & (beta > 0) & (beta < 1) & (length >= 1)
        if not ok.any():
            return  # at beta = 1 everything is kept: nothing to learn
        beta, length, kept = beta[ok], length[ok], kept[ok]
        residual = np.clip(kept, self._floor(beta), 1.0) - beta - self._uniform(beta, length)
        knot = np.rint(self._x(length)).astype(np.int64)
        self.mean, self.count = fold_in(self.mean, self.count, knot, residual, self.max_count)
        if self.beta_knots:
            cell = knot * (self.beta_knots + 1) + np.rint(beta * self.beta_knots).astype(np.int64)
            self.mean_b, self.count_b = fold_in(
                self.mean_b, self.count_b, cell, residual, self.max_count
            )
        self._refresh()

    def state_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "log2_len_min": self.log2_len_min,
            "log2_len_max": self.log2_len_max,
            "max_count": self.max_count,
            "measure": self.measure,
            "count": self.count.tolist(),
            "mean": self.mean.tolist(),
            # by budget only: a per-length model's state (and the snapshot digests the
            # sample logs record) stays what it was before the switch existed
            **(
                {
                    "beta_knots": self.beta_knots,
                    "count_b": self.count_b.tolist(),
                    "mean_b": self.mean_b.tolist(),
                }
                if self.beta_knots
                else {}
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = ("block_size", "log2_len_min", "log2_len_max", "max_count")
        measure = state.get("measure", "estimated")  # absent before true recall existed
        if measure != self.measure:  # corrections of another quantity: learn afresh
            return
        beta_knots = self.beta_knots  # the run's setting; by budget: learnt afresh if absent
        self.__init__(**{k: state[k] for k in keys}, measure=measure, beta_knots=beta_knots)
        self.mean, self.count = tables_from_state(state, self.count.shape, "RecallModel")
        if beta_knots and state.get("beta_knots") == beta_knots:
            self.mean_b, self.count_b = tables_from_state(
                {"mean": state["mean_b"], "count": state["count_b"]},
                self.count_b.shape,
                "RecallModel",
            )
        self._refresh()
