"""Latency predictor for one micro-batch on one pipeline stage, and its inverse.

A micro-batch is a list of document lengths (attention never crosses documents). Its
forward+backward time is modelled as

    T = rest_scale * (overhead + linear(tokens)) + attn_scale * sum_d attn(L_d, rho_d)

with `linear` and `attn` interpolated from a measured `Profile` (or built from FLOPs by
`analytic_profile`), and the two scales refitted online from measured step times.
The model is monotone in every length and density, so budgets invert by bisection.
See docs/cost_model.md for the assumptions and the file format.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Unpack

import numpy as np

from sb_titan.balance.cost_model.analytic import (
    ANALYTIC_DEVICES,
    AnalyticDevice,
    AnalyticSpec,
    analytic_profile,
)
from sb_titan.balance.cost_model.batch import UnitBatch
from sb_titan.balance.cost_model.blocks import (
    MicroBatch,
    Unit,
    block_pairs,
    check_policy,
    forced_density,
    lerp,
)
from sb_titan.balance.cost_model.density import DensityModel
from sb_titan.balance.cost_model.fingerprint import check_fingerprint
from sb_titan.balance.cost_model.options import CostModelOptions
from sb_titan.balance.cost_model.profile import (
    MIN_SECONDS,
    Profile,
    ProfileNotFoundError,
)
from sb_titan.balance.cost_model.recall import RecallMeasure, RecallModel

logger = logging.getLogger(__name__)


_BISECT_STEPS = 50  # fixed: 2**-50 of the budget range, identical work on every rank


class BudgetSolution(NamedTuple):
    beta: float
    predicted_s: float
    clamped: int  # 0 reachable; -1 even beta_min is slower; +1 even beta_max is faster


class LatencyObservation(NamedTuple):
    doc_lens: Sequence[int]  # one micro-batch
    densities: float | Sequence[float]  # realised, scalar or per document
    seconds: float  # measured fwd+bwd of that micro-batch on this stage


def _as_unit(work: MicroBatch | Unit) -> list[MicroBatch]:
    """One micro-batch (list of ints) or a unit (list of micro-batches) -> a unit."""
    if len(work) and not isinstance(work[0], int | np.integer):
        return list(work)
    return [work]


class CostModel:
    """Predicts, inverts and recalibrates micro-batch latency from a Profile."""

    def __init__(
        self,
        profile: Profile,
        density_model: DensityModel | None = None,
        *,
        refit_rate: float = 0.2,
        ape_rate: float = 0.1,
        ridge: float = 0.01,
        scale_bounds: tuple[float, float] = (0.05, 20.0),
        recall_measure: RecallMeasure = "estimated",
        recall_beta_knots: int = 0,
    ) -> None:
        self.profile = profile
        self.density_model = density_model if density_model is not None else DensityModel()
        self.block_size = profile.block_size
        # DST's (dst.py): it learns the recall measure the `recall` anchor holds
        self.recall_model = RecallModel(block_size=self.block_size, measure=recall_measure,
                                        beta_knots=recall_beta_knots)  # fmt: skip
        self.refit_rate, self.ape_rate, self.ridge = refit_rate, ape_rate, ridge
        self.scale_bounds = scale_bounds
        self._profile_digest = profile.digest()
        attn = np.asarray(profile.attn_seconds, dtype=np.float64)
        mono = np.maximum.accumulate(np.maximum.accumulate(attn, axis=1), axis=0)
        lin = np.asarray(profile.linear_seconds, dtype=np.float64)
        mono_lin = np.maximum.accumulate(lin)
        if (mono != attn).any() or (mono_lin != lin).any():
            logger.info("%s: made the profile monotone (measurement noise)", profile.source)
        self._lengths = np.asarray(profile.lengths, dtype=np.float64)
        self._log_len = np.log(self._lengths)
        self._log_attn = np.log(np.maximum(mono, MIN_SECONDS))
        self._edge_pairs = block_pairs(self._lengths[[0, -1]], self.block_size)
        self._dens = np.asarray(profile.densities, dtype=np.float64)
        self._tokens = np.asarray(profile.linear_tokens, dtype=np.float64)
        self._linear_s = mono_lin
        self._overhead = profile.overhead_seconds
        self.attn_scale = 1.0
        self.rest_scale = 1.0
        self.ape_ema = 0.0
        self.n_refits = 0

    @classmethod
    def analytic(cls, spec: AnalyticSpec, **kwargs: Unpack[CostModelOptions]) -> CostModel:
        return cls(analytic_profile(spec), **kwargs)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        *,
        analytic: AnalyticSpec | None = None,
        **kwargs: Unpack[CostModelOptions],
    ) -> CostModel:
        """Load a profile; fall back to the analytic model only if one is passed."""
        try:
            return cls(Profile.load(path), **kwargs)
        except ProfileNotFoundError:
            if analytic is None:
                raise
            logger.warning("no profile at %s: using the analytic cost model %s", path, analytic)
            return cls.analytic(analytic, **kwargs)

    # -- the unscaled terms

    def _attn_rows(self, lengths: np.ndarray) -> np.ndarray:
        """[D, J]: one document's attention seconds at each profiled density.

        Power law (log-log linear) between profiled lengths, which keeps monotonicity;
        outside the grid, the edge's cost per causal block pair times the pair count.
        """
        log_len = np.log(np.maximum(lengths, 1.0))
        i = np.clip(
            np.searchsorted(self._log_len, log_len, side="right") - 1, 0, len(self._lengths) - 2
        )
        t = (log_len - self._log_len[i]) / (self._log_len[i + 1] - self._log_len[i])
        t = np.clip(t, 0.0, 1.0)[:, None]
        rows = np.exp(lerp(self._log_attn[i], self._log_attn[i + 1], t))
        pairs = block_pairs(lengths, self.block_size)
        scale = np.where(lengths < self._lengths[0], pairs / self._edge_pairs[0], 1.0)
        scale = np.where(lengths > self._lengths[-1], pairs / self._edge_pairs[1], scale)
        return rows * scale[:, None]

    def _attn_at(self, rows: np.ndarray, rho: np.ndarray) -> np.ndarray:
        """Per-document seconds at density rho: linear between profiled densities."""
        rho = np.clip(rho, self._dens[0], self._dens[-1])
        j = np.clip(np.searchsorted(self._dens, rho, side="right") - 1, 0, len(self._dens) - 2)
        s = (rho - self._dens[j]) / (self._dens[j + 1] - self._dens[j])
        flat = np.arange(0, rows.size, rows.shape[1]) + j  # rows[d, j] without a 2-D gather
        return lerp(rows.ravel()[flat], rows.ravel()[flat + 1], s)

    def _linear(self, tokens: np.ndarray) -> np.ndarray:
        """Token-linear seconds: piecewise linear; proportional below, last slope above."""
        tok, lin = self._tokens, self._linear_s
        slope = (lin[-1] - lin[-2]) / (tok[-1] - tok[-2])
        out = np.interp(tokens, tok, lin)
        out = np.where(tokens < tok[0], lin[0] * tokens / tok[0], out)
        return np.where(tokens > tok[-1], lin[-1] + slope * (tokens - tok[-1]), out)

    def _batch(self, units: Sequence[Unit]) -> UnitBatch:
        mbs = [mb for unit in units for mb in unit]
        per_mb = np.fromiter(map(len, mbs), dtype=np.int64, count=len(mbs))
        flat = [x for mb in mbs for x in mb]
        ints = np.array(flat, dtype=np.float64 if not flat else None).astype(np.int64)
        if (ints < 0).any():
            bad = int(np.searchsorted(np.cumsum(per_mb), np.argmax(ints < 0), side="right"))
            raise ValueError(f"document lengths must be >= 0, got {[int(x) for x in mbs[bad]]}")
        lengths = ints.astype(np.float64)
        mb_of_doc = np.repeat(np.arange(len(mbs)), per_mb)
        tokens = np.bincount(mb_of_doc, lengths, len(mbs))  # integer sums: exact
        per_unit = np.fromiter(map(len, units), dtype=np.int64, count=len(units))
        unit_of_mb = np.repeat(np.arange(len(units)), per_unit)
        mb_rest = self._overhead + self._linear(tokens)
        return UnitBatch(
            lengths=lengths,
            unit=unit_of_mb[mb_of_doc],
            rows=self._attn_rows(lengths),
            forced=forced_density(lengths, self.block_size),
            rest=np.bincount(unit_of_mb, mb_rest, len(units)),
        )

    def _unit_terms(self, batch: UnitBatch, rho: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([U] attention, [U] rest) unscaled seconds, given every document's density."""
        attn = np.bincount(batch.unit, self._attn_at(batch.rows, rho), len(batch.rest))
        return attn, batch.rest

    def _seconds(self, batch: UnitBatch, rho: np.ndarray) -> np.ndarray:
        attn, rest = self._unit_terms(batch, rho)
        return self.rest_scale * rest + self.attn_scale * attn

    def _rho(self, batch: UnitBatch, beta: np.ndarray, policy: str) -> np.ndarray:
        if policy == "topk":
            rho = beta[batch.unit]
        else:
            if batch.density_rows is None:
                batch.density_rows = self.density_model.length_rows(batch.lengths)
            rho = self.density_model.predict_rows(batch.density_rows, beta, batch.unit)
        return np.minimum(1.0, np.maximum(rho, batch.forced))

    def _terms(self, doc_lens: MicroBatch, density: float | Sequence[float]) -> tuple[float, float]:
        """(attention, rest) unscaled seconds of one micro-batch at given densities."""
        batch = self._batch([[doc_lens]])
        rho = np.asarray(density, dtype=np.float64)
        if rho.ndim and rho.shape != batch.lengths.shape:
            raise ValueError(f"{rho.size} densities for {batch.lengths.size} documents")
        rho = np.broadcast_to(rho, batch.lengths.shape)
        if not (np.isfinite(rho).all() and (rho >= 0).all() and (rho <= 1).all()):
            raise ValueError(f"densities must lie in [0, 1], got {density}")
        attn, rest = self._unit_terms(batch, rho)
        return float(attn[0]), float(rest[0])

    def _terms_many(
        self, work: Sequence[tuple[MicroBatch, float | Sequence[float]]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """`_terms` of many micro-batches in one batch (bit-identical per micro-batch:
        each sum runs over the same documents in the same order)."""
        batch = self._batch([[doc_lens] for doc_lens, _ in work])
        counts = np.bincount(batch.unit, minlength=len(work))
        rhos = []
        for (_, density), n in zip(work, counts.tolist(), strict=True):
            rho = np.asarray(density, dtype=np.float64)
            if rho.ndim and rho.shape != (n,):
                raise ValueError(f"{rho.size} densities for {n} documents")
            rhos.append(np.broadcast_to(rho, (n,)))
        rho = np.concatenate(rhos) if rhos else np.zeros(0)
        bad = ~(np.isfinite(rho) & (rho >= 0) & (rho <= 1))
        if bad.any():
            density = work[int(batch.unit[np.argmax(bad)])][1]
            raise ValueError(f"densities must lie in [0, 1], got {density}")
        return self._unit_terms(batch, rho)

    # -- prediction

    def predict(self, doc_lens: MicroBatch, density: float | Sequence[float]) -> float:
        """Seconds of one micro-batch with the given density (scalar or per document)."""
        attn, rest = self._terms(doc_lens, density)
        return self.rest_scale * rest + self.attn_scale * attn

    def density_for_budget(self, beta: float, length: int, policy: str) -> float:
        """Realised density of a document of `length` tokens at budget beta."""
        return float(self.densities(beta, np.array([length]), policy)[0])

    def densities(self, beta: float | np.ndarray, lengths: np.ndarray, policy: str) -> np.ndarray:
        """Realised density of documents of `lengths` tokens at budget beta (or one each)."""
        check_policy(policy)
        lengths = np.asarray(lengths, dtype=np.float64)
        beta = np.broadcast_to(np.asarray(beta, dtype=np.float64), lengths.shape)
        rho = beta if policy == "topk" else self.density_model.predict(beta, lengths)
        return np.minimum(1.0, np.maximum(rho, forced_density(lengths, self.block_size)))

    def document_seconds(self, lengths: np.ndarray, beta, policy: str) -> np.ndarray:
        """Attention seconds of each document at its budget (one, or one per document)."""
        rho = self.densities(beta, lengths, policy)
        return self.attn_scale * self._attn_at(self._attn_rows(np.asarray(lengths, float)), rho)

    def predict_units(
        self, units: Sequence[Unit], beta: float | Sequence[float], policy: str
    ) -> np.ndarray:
        """[U] seconds of each unit (sum over its micro-batches) at budget beta."""
        check_policy(policy)
        return self.predict_batch(self._batch(units), beta, policy)

    def prepare(self, units: Sequence[Unit]) -> UnitBatch:
        """Flatten units once for several `predict_batch` / `solve_budgets` calls."""
        return self._batch(units)

    def predict_batch(
        self, batch: UnitBatch, beta: float | Sequence[float], policy: str
    ) -> np.ndarray:
        """`predict_units` on prepared units (bit-identical)."""
        betas = np.broadcast_to(np.asarray(beta, dtype=np.float64), (batch.n_units,))
        return self._seconds(batch, self._rho(batch, betas, policy))

    def predict_budget(self, work: MicroBatch | Unit, beta: float, policy: str) -> float:
        """Seconds of one micro-batch, or of a unit of micro-batches, at budget beta."""
        return float(self.predict_units([_as_unit(work)], beta, policy)[0])

    # -- inversion

    def budgets_for(
        self,
        units: Sequence[Unit],
        targets_s: float | Sequence[float],
        policy: str,
        beta_min: float | Sequence[float],
        beta_max: float | Sequence[float],
    ) -> list[BudgetSolution]:
        """Per unit, the largest budget in [beta_min, beta_max] predicted within target.

        Lock-step bisection over all units with a fixed step count: deterministic, and
        one vectorised evaluation per step however many units there are.
        """
        check_policy(policy)
        beta, pred, clamped = self.solve_budgets(
            self._batch(units), targets_s, policy, beta_min, beta_max
        )
        return [
            BudgetSolution(float(x), float(p), int(c))
            for x, p, c in zip(beta, pred, clamped, strict=True)
        ]

    def solve_budgets(
        self,
        batch: UnitBatch,
        targets_s: float | Sequence[float],
        policy: str,
        beta_min: float | Sequence[float],
        beta_max: float | Sequence[float],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`budgets_for` on prepared units, as arrays (budgets, seconds, clamped)."""
        check_policy(policy)
        n = batch.n_units
        lo = np.broadcast_to(np.asarray(beta_min, dtype=np.float64), (n,)).copy()
        hi = np.broadcast_to(np.asarray(beta_max, dtype=np.float64), (n,)).copy()
        if not ((lo > 0) & (lo <= hi) & (hi <= 1)).all():
            raise ValueError(f"need 0 < beta_min <= beta_max <= 1, got {beta_min}, {beta_max}")
        target = np.broadcast_to(np.asarray(targets_s, dtype=np.float64), (n,))
        f = lambda beta: self._seconds(batch, self._rho(batch, beta, policy))
        slow, fits_hi = f(lo) > target, f(hi) <= target
        a, b = lo.copy(), hi.copy()
        for _ in range(_BISECT_STEPS):
            mid = 0.5 * (a + b)
            ok = f(mid) <= target
            a, b = np.where(ok, mid, a), np.where(ok, b, mid)
        beta = np.where(slow, lo, np.where(fits_hi, hi, a))
        pred = f(beta)
        clamped = np.where(slow, -1, np.where(fits_hi & (pred < target), 1, 0))
        return beta, pred, clamped

    def budget_for(
        self,
        work: MicroBatch | Unit,
        target_s: float,
        policy: str,
        beta_min: float,
        beta_max: float,
    ) -> BudgetSolution:
        """The budget whose predicted seconds for `work` is target_s (see budgets_for)."""
        return self.budgets_for([_as_unit(work)], target_s, policy, beta_min, beta_max)[0]

    # -- online recalibration

    def refit(self, observations: Iterable[LatencyObservation | tuple]) -> None:
        """Damped least-squares correction of the attention and rest scales.

        Minimises the squared relative error over the observations plus a ridge pull
        toward the current scales, then moves a `refit_rate` step toward the solution.
        Sums use math.fsum (exactly rounded, order-free), so identical observations on
        every rank give bit-identical scales.
        """
        kept = [
            (doc_lens, densities, float(seconds))
            for doc_lens, densities, seconds in observations
            if math.isfinite(float(seconds)) and float(seconds) > 0
        ]
        if not kept:
            return
        attn, rest = self._terms_many([(lens, rho) for lens, rho, _ in kept])
        seconds_a = np.asarray([s for _, _, s in kept])
        xs, zs = (attn / seconds_a).tolist(), (rest / seconds_a).tolist()
        a0, b0 = self.attn_scale, self.rest_scale
        ape = math.fsum(abs(a0 * x + b0 * z - 1.0) for x, z in zip(xs, zs, strict=True)) / len(xs)
        self.ape_ema = (
            ape if self.n_refits == 0 else self.ape_ema + self.ape_rate * (ape - self.ape_ema)
        )
        lam = self.ridge * len(xs)
        sxx = math.fsum(x * x for x in xs) + lam
        szz = math.fsum(z * z for z in zs) + lam
        sxz = math.fsum(x * z for x, z in zip(xs, zs, strict=True))
        sx = math.fsum(xs) + lam * a0
        sz = math.fsum(zs) + lam * b0
        det = sxx * szz - sxz * sxz
        lo, hi = self.scale_bounds
        a = min(max((sx * szz - sz * sxz) / det, lo), hi)
        b = min(max((sz * sxx - sx * sxz) / det, lo), hi)
        self.attn_scale = a0 + self.refit_rate * (a - a0)
        self.rest_scale = b0 + self.refit_rate * (b - b0)
        self.n_refits += 1

    def drift_warning(self, threshold: float = 0.15) -> str | None:
        """A message when the smoothed prediction error exceeds threshold, else None."""
        if self.n_refits == 0 or self.ape_ema <= threshold:
            return None
        return (
            f"cost model: mean absolute prediction error {self.ape_ema:.1%} (EMA over "
            f"{self.n_refits} refits) exceeds {threshold:.0%}; the profile "
            f"{self.profile.source} may not match this environment; re-run "
            "`sb-profile --config <config.toml> --out <path>`"
        )

    def check_fingerprint(
        self, expected: dict[str, Any], strict: bool = False, allow_shape_mismatch: bool = False
    ) -> list[str]:
        """Keys of `expected` whose profile value differs (fingerprint.py: which refuse)."""
        have = {**self.profile.fingerprint, "block_size": self.profile.block_size}
        return check_fingerprint(self.profile.source, have, expected, strict, allow_shape_mismatch)

    # -- checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {
            "profile_digest": self._profile_digest,
            "attn_scale": self.attn_scale,
            "rest_scale": self.rest_scale,
            "ape_ema": self.ape_ema,
            "n_refits": self.n_refits,
            "density_model": self.density_model.state_dict(),
            "recall_model": self.recall_model.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; calibration fit on a different profile is dropped with a warning."""
        self.density_model.load_state_dict(state["density_model"])
        if "recall_model" in state:  # absent in checkpoints written before it existed
            self.recall_model.load_state_dict(state["recall_model"])
        if state["profile_digest"] != self._profile_digest:
            logger.warning(
                "%s: checkpointed cost-model calibration was fit on another profile; "
                "starting calibration afresh",
                self.profile.source,
            )
            return
        self.attn_scale = float(state["attn_scale"])
        self.rest_scale = float(state["rest_scale"])
        self.ape_ema = float(state["ape_ema"])
        self.n_refits = int(state["n_refits"])

    def digest(self) -> str:
        """Hash of the profile and the learned state, to assert ranks agree."""
        blob = json.dumps(self.state_dict(), sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()


@dataclass(kw_only=True, slots=True)
class CostModelConfig:
    """The `[cost_model]` section."""

    profile: str | None = None
    """A `sb-profile` JSON measured on this device for this model and stage split."""
    analytic_device: AnalyticDevice | None = None
    """Explicit opt-in FLOP model instead of (or when missing) a profile."""
    strict_fingerprint: bool = False
    """Any fingerprint difference (device, driver, torch too) is an error, not a warning."""
    allow_shape_mismatch: bool = False
    """Train with a profile measured for another model shape or stage layout (refused by
    default: it prices other work), with a warning."""
    refit: bool = True
    """Recalibrate online from measured micro-batch times (identical on every rank)."""
    drift_threshold: float = 0.15
    """Warn when the prediction error's moving average exceeds this fraction."""
    plan_lag: int = 2
    """Step t is packed (SAB) and budgeted (DST) ahead, in the loader's thread, with the
    model as refit after step t - plan_lag. 1 puts planning back on the step's critical
    path (it must wait for the previous step's refit); 2 overlaps it with one step."""

    def __post_init__(self) -> None:
        if self.plan_lag < 1:
            raise ValueError(f"cost_model.plan_lag: must be >= 1 (got {self.plan_lag})")
        if self.analytic_device is not None and self.analytic_device not in ANALYTIC_DEVICES:
            raise ValueError(
                f"cost_model.analytic_device: {self.analytic_device!r} is not one of "
                f"{sorted(ANALYTIC_DEVICES)}"
            )


def build_cost_model(
    config: CostModelConfig,
    spec_for: Callable[[str], AnalyticSpec],
    expected: dict[str, Any],
    recall_measure: RecallMeasure = "estimated",
    recall_beta_knots: int = 0,
) -> CostModel | None:
    """The run's cost model, or None when neither a profile nor the analytic fallback
    was configured (callers that need one say which command makes it)."""
    fallback = spec_for(config.analytic_device) if config.analytic_device else None
    recall = {"recall_measure": recall_measure, "recall_beta_knots": recall_beta_knots}
    if config.profile is None:
        return None if fallback is None else CostModel.analytic(fallback, **recall)
    model = CostModel.from_file(config.profile, analytic=fallback, **recall)
    if model.profile.source != "<memory>":
        model.check_fingerprint(expected, config.strict_fingerprint, config.allow_shape_mismatch)
    return model
