"""Budget -> realised density for the `mass` policy, learned from measurements."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from sb_titan.balance.cost_model.blocks import lerp
from sb_titan.balance.cost_model.knot_means import fold_in, nearest, tables_from_state


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted pool-adjacent-violators: the closest non-decreasing sequence."""
    blocks: list[list[float]] = []  # [sum w*y, sum w, length]
    for yi, wi in zip(y.tolist(), w.tolist(), strict=True):
        blocks.append([wi * yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            s, ws, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += ws
            blocks[-1][2] += n
    return np.array([s / ws for s, ws, n in blocks for _ in range(int(n))])


class DensityModel:
    """rho_hat(beta, L): realised density of the `mass` policy at budget beta.

    A table over knots beta = k/beta_knots (k = 1..beta_knots) and log2 L (integer
    knots), each knot a running mean of the densities reported for it (an exact mean
    up to max_count observations, then an EMA with rate 1/max_count so it follows the
    model as attention sharpens during training). Before any observation rho_hat =
    beta**prior_exponent; k = 1 is an upper bound, since the top ceil(beta*n) key
    blocks by mass always hold at least beta of it. Unobserved knots follow the prior's
    shape scaled to the nearest observed knot; each length's row is made
    non-decreasing in beta (weighted isotonic regression); lookups interpolate.
    """

    def __init__(
        self,
        *,
        prior_exponent: float = 1.0,
        beta_knots: int = 20,
        log2_len_min: int = 6,
        log2_len_max: int = 20,
        max_count: int = 256,
    ) -> None:
        self._configure(prior_exponent, beta_knots, log2_len_min, log2_len_max, max_count)

    def _configure(
        self,
        prior_exponent: float,
        beta_knots: int,
        log2_len_min: int,
        log2_len_max: int,
        max_count: int,
    ) -> None:
        """Set the hyper-parameters and start from the prior (no observations)."""
        if prior_exponent <= 0 or beta_knots < 2 or log2_len_max <= log2_len_min:
            raise ValueError(
                "DensityModel: need prior_exponent > 0, beta_knots >= 2 and "
                "log2_len_min < log2_len_max"
            )
        if max_count < 1:
            raise ValueError("DensityModel: max_count must be >= 1")
        self.prior_exponent = float(prior_exponent)
        self.beta_knots = int(beta_knots)
        self.log2_len_min = int(log2_len_min)
        self.log2_len_max = int(log2_len_max)
        self.max_count = int(max_count)
        shape = (self.log2_len_max - self.log2_len_min + 1, self.beta_knots)
        self.count = np.zeros(shape, dtype=np.int64)
        self.mean = np.zeros(shape, dtype=np.float64)
        self._refresh()

    @property
    def _betas(self) -> np.ndarray:
        return np.arange(1, self.beta_knots + 1, dtype=np.float64) / self.beta_knots

    def _refresh(self) -> None:
        prior = np.broadcast_to(self._betas**self.prior_exponent, self.count.shape)
        seen = self.count > 0
        if not seen.any():
            self.table = prior.copy()
            return
        ratio = np.where(seen, self.mean / prior, np.nan)
        rows = np.flatnonzero(seen.any(axis=1))
        for i in rows:  # unobserved betas: the ratio of the nearest observed beta
            ratio[i] = ratio[i, nearest(np.flatnonzero(seen[i]), self.beta_knots)]
        ratio = ratio[nearest(rows, len(ratio))]  # unobserved lengths: nearest observed
        filled = np.where(seen, self.mean, np.clip(prior * ratio, 0.0, 1.0))
        weight = np.where(seen, np.minimum(self.count, self.max_count), 0.01)
        self.table = np.stack([_isotonic(f, w) for f, w in zip(filled, weight, strict=True)])

    def _coords(self, beta: np.ndarray, lengths: np.ndarray):
        x = np.log2(np.maximum(lengths, 1.0)) - self.log2_len_min
        x = np.clip(x, 0.0, self.count.shape[0] - 1)
        y = np.clip(beta * self.beta_knots - 1.0, 0.0, self.beta_knots - 1)
        return x, y

    def predict(self, beta: np.ndarray | float, lengths: np.ndarray | Sequence[int]) -> np.ndarray:
        """rho_hat per document; continuous and non-decreasing in beta."""
        beta, lengths = np.broadcast_arrays(
            np.asarray(beta, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
        )
        x, y = self._coords(beta, lengths)
        i = np.minimum(np.floor(x).astype(np.int64), self.count.shape[0] - 2)
        j = np.minimum(np.floor(y).astype(np.int64), self.beta_knots - 2)
        u, v = x - i, y - j
        t = self.table
        return lerp(lerp(t[i, j], t[i, j + 1], v), lerp(t[i + 1, j], t[i + 1, j + 1], v), u)

    def length_rows(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(table row at each length's lower knot [D, K], at its upper knot [D, K], weight
        [D]): the budget-independent half of `predict`, done once per document so a
        bisection over budgets only redoes the other half (`predict_rows`)."""
        x, _ = self._coords(np.zeros(1), np.asarray(lengths, dtype=np.float64))
        i = np.minimum(np.floor(x).astype(np.int64), self.count.shape[0] - 2)
        return self.table[i], self.table[i + 1], x - i

    def predict_rows(
        self,
        rows: tuple[np.ndarray, np.ndarray, np.ndarray],
        beta: np.ndarray,
        index: np.ndarray | None = None,
    ) -> np.ndarray:
        """`predict` from `length_rows` at budget beta[index[d]] for document d (beta
        per document without index): the same arithmetic in the same order, so
        bit-identical to it; the budget's half is done once per distinct budget."""
        lo, hi, u = rows
        y = np.clip(beta * self.beta_knots - 1.0, 0.0, self.beta_knots - 1)
        j = np.minimum(np.floor(y).astype(np.int64), self.beta_knots - 2)
        v = y - j
        if index is not None:
            j, v = j[index], v[index]
        flat = np.arange(0, lo.size, lo.shape[1]) + j  # [d, j] without a 2-D gather
        lo, hi = lo.ravel(), hi.ravel()
        return lerp(lerp(lo[flat], lo[flat + 1], v), lerp(hi[flat], hi[flat + 1], v), u)

    def update(self, observations: Iterable[tuple[float, int, float]]) -> None:
        """Fold in (beta, length, realised density) triples, in the order given."""
        obs = np.asarray(list(observations), dtype=np.float64).reshape(-1, 3)
        beta, length, rho = obs.T
        ok = np.isfinite(obs).all(axis=1) & (beta > 0) & (beta <= 1) & (rho > 0) & (rho <= 1)
        ok &= length >= 1
        if not ok.any():
            return
        beta, length, rho = beta[ok], length[ok], rho[ok]
        x, y = self._coords(beta, length)
        flat = np.rint(x).astype(np.int64) * self.beta_knots + np.rint(y).astype(np.int64)
        self.mean, self.count = fold_in(self.mean, self.count, flat, rho, self.max_count)
        self._refresh()

    def state_dict(self) -> dict[str, Any]:
        return {
            "prior_exponent": self.prior_exponent,
            "beta_knots": self.beta_knots,
            "log2_len_min": self.log2_len_min,
            "log2_len_max": self.log2_len_max,
            "max_count": self.max_count,
            "count": self.count.tolist(),
            "mean": self.mean.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = ("prior_exponent", "beta_knots", "log2_len_min", "log2_len_max", "max_count")
        self._configure(*(state[k] for k in keys))
        self.mean, self.count = tables_from_state(state, self.count.shape, "DensityModel")
        self._refresh()
