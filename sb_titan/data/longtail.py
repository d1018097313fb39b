"""The `longtail-v1` reference length mix (shared/REFERENCE_MIX.md).

Scale-free in the row length R, so the same mix serves R=4096 on a CPU and R=65536
on a cluster; every benchmark and simulation draws from here so figures compare.
"""

from __future__ import annotations

import math

import numpy as np

SHORT_PROB = 0.85
SHORT_SIGMA = 1.0
MIN_LEN = 16
LONG_SPAN = 8.0  # long documents are log-uniform in [R/8, R]


def longtail_v1(num_docs: int, row_len: int, seed: int) -> np.ndarray:
    """Lengths of `num_docs` documents; document i has stable id i (its draw index)."""
    if num_docs < 0 or row_len < MIN_LEN:
        raise ValueError(f"longtail_v1: need num_docs >= 0 and row_len >= {MIN_LEN}")
    rng = np.random.default_rng(seed)
    is_short = rng.random(num_docs) < SHORT_PROB
    short = np.exp(rng.normal(math.log(row_len / 40), SHORT_SIGMA, num_docs))
    long = row_len * LONG_SPAN ** (-rng.random(num_docs))
    lengths = np.where(is_short, short, long)
    return np.clip(np.rint(lengths), MIN_LEN, row_len).astype(np.int64)
