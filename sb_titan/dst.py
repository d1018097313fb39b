"""DST: workload-aware dynamic sparsity tuning.

Each step, every work unit (a DP rank's micro-batches, or one PP micro-batch) is
predicted at the default budget beta0; units predicted above anchor*(1+p) get the
budget whose predicted latency is the anchor (sparser, never below beta_min), units
below anchor*(1-p) get the budget whose predicted latency is the anchor (denser, never
above beta_max). A pure function of the plan and the cost model, so every rank that
holds the same plan and the same synchronised cost model decides the same budgets.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import tyro

from sb_titan.cost_model import POLICIES, CostModel, Unit

ANCHORS = ("min", "mean", "median", "max")


@dataclass(kw_only=True, slots=True)
class DSTConfig:
    """The `[dst]` section."""

    enabled: bool = True
    """Off: every unit trains at beta0 (predictions are still made, for logging)."""
    anchor: str = "mean"
    """Statistic of the units' predicted latencies to pull toward: one of ANCHORS.
    The paper found mean best and min harmful."""
    p: float = 0.1
    """Tolerance: units within anchor*(1 +/- p) keep beta0."""
    beta0: float = 0.9
    """Default budget."""
    beta_min: float = 0.5
    """Floor for bottlenecks (accuracy guard)."""
    beta_max: float = 1.0
    """Ceiling for non-bottlenecks."""
    policy: Annotated[str, tyro.conf.Suppress] = "mass"
    """Selection policy the budget feeds; the trainer sets it from [sparse_attention]."""
    verify_ranks: bool = False
    """Debug: all-gather a hash of the step's budgets and fail if any rank disagrees."""

    def __post_init__(self) -> None:
        if self.anchor not in ANCHORS:
            raise ValueError(f"dst.anchor must be one of {ANCHORS}, got {self.anchor!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"dst.policy must be one of {POLICIES}, got {self.policy!r}")
        if not (math.isfinite(self.p) and self.p >= 0):
            raise ValueError(f"dst.p must be a finite number >= 0, got {self.p!r}")
        for name in ("beta_min", "beta0", "beta_max"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value <= 1):
                raise ValueError(f"dst.{name} must lie in (0, 1], got {value!r}")
        if not self.beta_min <= self.beta0 <= self.beta_max:
            raise ValueError(
                "dst: need beta_min <= beta0 <= beta_max, got "
                f"{self.beta_min} <= {self.beta0} <= {self.beta_max}"
            )


@dataclass(frozen=True)
class DSTDecision:
    budgets: list[float]  # per unit
    anchor_s: float
    predicted_before: list[float]  # per unit, at beta0
    predicted_after: list[float]  # per unit, at its budget
    n_raised: int  # units whose budget is above beta0
    n_lowered: int  # units whose budget is below beta0
    n_clamped: int  # units whose target was out of reach within [beta_min, beta_max]

    def digest(self) -> str:
        """Stable hash of the budget vector: ranks compare it to prove they agree."""
        return hashlib.sha1(np.asarray(self.budgets, dtype="<f8").tobytes()).hexdigest()

    @property
    def imbalance_before(self) -> float:
        return _imbalance(self.predicted_before)

    @property
    def imbalance_after(self) -> float:
        return _imbalance(self.predicted_after)


def _imbalance(seconds: Sequence[float]) -> float:
    """max/mean: 1.0 is perfect balance."""
    mean = math.fsum(seconds) / len(seconds)
    return max(seconds) / mean if mean > 0 else 1.0


def _anchor(seconds: np.ndarray, kind: str) -> float:
    """The anchor statistic, clamped into [min, max] so equal latencies give it exactly."""
    values = {
        "min": lambda: float(seconds.min()),
        "max": lambda: float(seconds.max()),
        "mean": lambda: math.fsum(seconds.tolist()) / len(seconds),
        "median": lambda: float(np.median(seconds)),
    }
    return min(max(values[kind](), float(seconds.min())), float(seconds.max()))


def tune_budgets(units: Sequence[Unit], cost_model: CostModel, cfg: DSTConfig) -> DSTDecision:
    """Budgets per unit that pull every predicted latency toward the anchor."""
    if not units or any(len(unit) == 0 for unit in units):
        raise ValueError("tune_budgets: need at least one unit, each with >= 1 micro-batch")
    before = cost_model.predict_units(units, cfg.beta0, cfg.policy)
    anchor = _anchor(before, cfg.anchor)
    budgets = np.full(len(units), cfg.beta0)
    after = before.copy()
    n_clamped = 0
    if cfg.enabled:
        slow = before > anchor * (1 + cfg.p)
        fast = before < anchor * (1 - cfg.p)
        idx = np.flatnonzero(slow | fast)
        if idx.size:
            # Bottlenecks search [beta_min, beta0], the rest [beta0, beta_max]: a unit
            # is never pushed the wrong way.
            solutions = cost_model.budgets_for(
                [units[i] for i in idx],
                anchor,
                cfg.policy,
                beta_min=np.where(slow[idx], cfg.beta_min, cfg.beta0),
                beta_max=np.where(slow[idx], cfg.beta0, cfg.beta_max),
            )
            for i, sol in zip(idx.tolist(), solutions, strict=True):
                budgets[i], after[i] = sol.beta, sol.predicted_s
                n_clamped += sol.clamped != 0
    return DSTDecision(
        budgets=budgets.tolist(),
        anchor_s=anchor,
        predicted_before=before.tolist(),
        predicted_after=after.tolist(),
        n_raised=int((budgets > cfg.beta0).sum()),
        n_lowered=int((budgets < cfg.beta0).sum()),
        n_clamped=int(n_clamped),
    )
