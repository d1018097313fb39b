"""How the planner prices a micro-batch: a latency function of its documents."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

CostFn = Callable[[Sequence[int], Sequence[float]], float]


DensityPrior = Callable[[int], float]


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
