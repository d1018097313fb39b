"""Running means on a grid of knots: the learned tables (density, recall) share them.

Each knot holds the mean of the values reported for it: exact up to `max_count`
observations, then an EMA with rate 1/max_count, so a table follows the model as its
attention sharpens during training instead of freezing on its first steps.
"""

from __future__ import annotations

import numpy as np


def fold_in(
    mean: np.ndarray, count: np.ndarray, index: np.ndarray, values: np.ndarray, max_count: int
) -> tuple[np.ndarray, np.ndarray]:
    """(mean, count) after folding `values` in at flat knot `index` (same shapes kept)."""
    size = mean.size
    k = np.bincount(index, minlength=size).reshape(mean.shape)
    s = np.bincount(index, weights=values, minlength=size).reshape(mean.shape)
    n = count + k
    w = np.where(k > 0, np.minimum(1.0, k / np.maximum(np.minimum(n, max_count), 1)), 0.0)
    return mean + w * (s / np.maximum(k, 1) - mean), n


def nearest(observed: np.ndarray, size: int) -> np.ndarray:
    """For each index in range(size), the nearest observed index (ties: the lower)."""
    return observed[np.argmin(np.abs(np.arange(size)[:, None] - observed[None, :]), axis=1)]


def tables_from_state(
    state: dict, shape: tuple[int, ...], owner: str
) -> tuple[np.ndarray, np.ndarray]:
    """(mean, count) from a state dict, checked against the configured table shape."""
    count = np.asarray(state["count"], dtype=np.int64)
    mean = np.asarray(state["mean"], dtype=np.float64)
    if count.shape != shape or mean.shape != shape:
        raise ValueError(f"{owner} state: expected tables of shape {shape}")
    return mean, count
