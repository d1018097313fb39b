"""Block-pair arithmetic the profile, the density model and the cost model share."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sb_titan.attention.selection import POLICIES

MicroBatch = Sequence[int]


Unit = Sequence[MicroBatch]


def block_pairs(lengths: np.ndarray, block_size: int) -> np.ndarray:
    """Causal block pairs of documents: n(n+1)/2 with n = ceil(L / block_size)."""
    n = np.ceil(np.asarray(lengths, dtype=np.float64) / block_size)
    return n * (n + 1) / 2


def forced_density(lengths: np.ndarray, block_size: int) -> np.ndarray:
    """Least possible density: the sink and diagonal blocks are always computed."""
    n = np.ceil(np.asarray(lengths, dtype=np.float64) / block_size)
    pairs = np.maximum(n * (n + 1) / 2, 1.0)
    return np.minimum(1.0, np.maximum(2 * n - 1, 1.0) / pairs)


def lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """a + t*(b - a): exact where a == b, so flat stretches stay flat under rounding."""
    return a + t * (b - a)


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
