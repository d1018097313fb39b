"""RecallModel: the estimated attention mass budget-sensitive query tokens keep.

A query token past the first two blocks of its document keeps at least beta of its
estimated mass under both selection policies (`mass` stops once it has beta; the top
ceil(beta * n) blocks by mass hold at least beta of it). What it keeps beyond beta, the
overshoot (the last block `mass` adds, the ceiling `topk` rounds up to, the forced sink
and diagonal blocks), depends on how many key blocks a query block sees, i.e. on the
document's length, far more than on beta. So

    r(beta, L) = min(1, beta + delta(L))

with one overshoot per integer log2-length knot, learned from measurements at *any*
budget (DST moves budgets away from beta0 exactly when it matters, so a model that only
learned at the budgets it saw would mispredict beta0 itself). Prior delta = 0: the
lower bound. DST (dst.py) predicts a step's recall with it; the trainer feeds it the
recall it measures.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np


class RecallModel:
    """r(beta, L) = min(1, beta + delta(L)); delta a running mean per log2-length knot."""

    def __init__(self, *, log2_len_min: int = 6, log2_len_max: int = 20, max_count: int = 256):
        if log2_len_max <= log2_len_min or max_count < 1:
            raise ValueError("RecallModel: need log2_len_min < log2_len_max and max_count >= 1")
        self.log2_len_min, self.log2_len_max = int(log2_len_min), int(log2_len_max)
        self.max_count = int(max_count)
        n = self.log2_len_max - self.log2_len_min + 1
        self.count = np.zeros(n, dtype=np.int64)
        self.mean = np.zeros(n, dtype=np.float64)
        self._refresh()

    def _refresh(self) -> None:
        """Unobserved knots take the nearest observed knot's overshoot (0 if none)."""
        seen = np.flatnonzero(self.count > 0)
        if not seen.size:
            self.delta = np.zeros_like(self.mean)
            return
        knots = np.arange(len(self.mean))
        nearest = seen[np.argmin(np.abs(knots[:, None] - seen[None, :]), axis=1)]
        self.delta = self.mean[nearest]

    def _x(self, lengths: np.ndarray) -> np.ndarray:
        x = np.log2(np.maximum(lengths, 1.0)) - self.log2_len_min
        return np.clip(x, 0.0, len(self.mean) - 1)

    def predict(self, beta: np.ndarray | float, lengths: np.ndarray | Sequence[int]) -> np.ndarray:
        """Kept mass per document; continuous and non-decreasing in beta, 1 at beta = 1."""
        beta, lengths = np.broadcast_arrays(
            np.asarray(beta, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
        )
        x = self._x(lengths)
        i = np.minimum(np.floor(x).astype(np.int64), len(self.mean) - 2)
        t = x - i
        delta = self.delta[i] + t * (self.delta[i + 1] - self.delta[i])
        return np.minimum(1.0, beta + delta)

    def update(self, observations: Iterable[tuple[float, int, float]]) -> None:
        """Fold in (beta, length, kept mass) triples: an exact mean per knot up to
        max_count observations, then an EMA (attention sharpens as training goes)."""
        obs = np.asarray(list(observations), dtype=np.float64).reshape(-1, 3)
        beta, length, kept = obs.T
        ok = np.isfinite(obs).all(axis=1) & (beta > 0) & (beta < 1) & (length >= 1)
        if not ok.any():
            return  # at beta = 1 everything is kept: no information about the overshoot
        beta, length, kept = beta[ok], length[ok], kept[ok]
        overshoot = np.clip(kept - beta, 0.0, 1.0 - beta)
        knot = np.rint(self._x(length)).astype(np.int64)
        k = np.bincount(knot, minlength=len(self.mean))
        s = np.bincount(knot, weights=overshoot, minlength=len(self.mean))
        n = self.count + k
        w = np.where(k > 0, np.minimum(1.0, k / np.maximum(np.minimum(n, self.max_count), 1)), 0.0)
        self.mean = self.mean + w * (s / np.maximum(k, 1) - self.mean)
        self.count = n
        self._refresh()

    def state_dict(self) -> dict[str, Any]:
        return {
            "log2_len_min": self.log2_len_min,
            "log2_len_max": self.log2_len_max,
            "max_count": self.max_count,
            "count": self.count.tolist(),
            "mean": self.mean.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(
            log2_len_min=state["log2_len_min"],
            log2_len_max=state["log2_len_max"],
            max_count=state["max_count"],
        )
        count = np.asarray(state["count"], dtype=np.int64)
        mean = np.asarray(state["mean"], dtype=np.float64)
        if count.shape != self.count.shape or mean.shape != self.mean.shape:
            raise ValueError(f"RecallModel state: expected tables of shape {self.count.shape}")
        self.count, self.mean = count, mean
        self._refresh()
