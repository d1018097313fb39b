"""Kept key blocks per query block, learned from observed block tables.

`predicted_block_pairs` prices a query block from a per-document density rho(L): the
growth of rho(n Bs) n(n+1)/2 from n - 1 to n visible blocks. That is exact when the
density model is, but the trainer learns rho from one number per micro-batch (its
density, attributed to its longest document), so the shape in n is a prior, not data.

`BlockProfile` learns the shape itself: the mean kept count (over kv heads) of the query
blocks that may see n key blocks, on log2 n bins, straight from the tables selection
returns. Under causal attention a query block's kept count depends on what it may see,
not on its document's final length, so n is the natural variable; the profile is what a
split needs (a cost per query block) with nothing in between.
"""

from __future__ import annotations

import numpy as np


class BlockProfile:
    """c_hat(beta, n): predicted kept key blocks of a query block that may see n blocks.

    Per budget knot (beta rounded to 1/beta_knots) and log2 n bin, running sums of n and
    of the kept count; a prediction interpolates linearly between the bins' (mean n,
    mean count) points, through (0, 0) below the first, along the last segment above
    the last (a profile that grows linearly in n stays linear). Budgets without
    observations use the nearest observed knot. Predictions are clipped to [1, n] (the
    diagonal is always kept, nothing beyond n)."""

    def __init__(self, *, beta_knots: int = 20, max_log2_n: int = 24) -> None:
        if beta_knots < 1 or max_log2_n < 1:
            raise ValueError("BlockProfile: need beta_knots >= 1 and max_log2_n >= 1")
        self.beta_knots = beta_knots
        shape = (beta_knots + 1, max_log2_n + 1)
        self.count = np.zeros(shape, dtype=np.float64)
        self.sum_n = np.zeros(shape, dtype=np.float64)
        self.sum_kept = np.zeros(shape, dtype=np.float64)

    def _knot(self, beta: float) -> int:
        return int(np.clip(np.rint(float(beta) * self.beta_knots), 0, self.beta_knots))

    def _bin(self, n: np.ndarray) -> np.ndarray:
        return np.clip(np.floor(np.log2(np.maximum(n, 1))), 0, self.count.shape[1] - 1)

    def update(self, beta: float, allowed: np.ndarray, kept: np.ndarray) -> None:
        """allowed: blocks each query block may see; kept: its kept blocks (mean over kv
        heads), same shape. Padding blocks (n = 1) count like any other."""
        n = np.asarray(allowed, dtype=np.float64).ravel()
        c = np.asarray(kept, dtype=np.float64).ravel()
        if n.shape != c.shape:
            raise ValueError(f"BlockProfile.update: {n.shape} allowed vs {c.shape} kept")
        k, b = self._knot(beta), self._bin(n).astype(np.int64)
        size = self.count.shape[1]
        self.count[k] += np.bincount(b, minlength=size)
        self.sum_n[k] += np.bincount(b, n, minlength=size)
        self.sum_kept[k] += np.bincount(b, c, minlength=size)

    def observed(self, beta: float) -> bool:
        return bool(self.count[self._knot(beta)].any())

    def predict(self, beta: float, allowed: np.ndarray) -> np.ndarray:
        """Predicted kept blocks per query block (same shape as `allowed`)."""
        seen = np.flatnonzero(self.count.any(axis=1))
        if not len(seen):
            raise ValueError("BlockProfile.predict: nothing observed yet")
        k = int(seen[np.argmin(np.abs(seen - self._knot(beta)))])
        live = self.count[k] > 0
        xs = self.sum_n[k, live] / self.count[k, live]
        ys = self.sum_kept[k, live] / self.count[k, live]
        xs, ys = np.concatenate([[0.0], xs]), np.concatenate([[0.0], ys])
        n = np.asarray(allowed, dtype=np.float64)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        out = np.where(n > xs[-1], ys[-1] + slope * (n - xs[-1]), np.interp(n, xs, ys))
        return np.clip(out, 1.0, np.maximum(n, 1.0))
