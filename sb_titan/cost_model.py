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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from sb_titan.knot_means import fold_in, nearest, tables_from_state
from sb_titan.recall_model import RecallModel

logger = logging.getLogger(__name__)

PROFILE_FORMAT = "sb_titan.profile"
PROFILE_VERSION = 1
POLICIES = ("mass", "topk")
_MIN_SECONDS = 1e-12  # floor for table entries, so log-length interpolation stays finite
_BISECT_STEPS = 50  # fixed: 2**-50 of the budget range, identical work on every rank

MicroBatch = Sequence[int]
Unit = Sequence[MicroBatch]


class ProfileError(ValueError):
    """A latency profile that cannot be used: corrupt, incomplete or mismatched."""


class ProfileNotFoundError(ProfileError, FileNotFoundError):
    """No profile at the configured path."""


def missing_profile_message(path: str | os.PathLike) -> str:
    return (
        f"no latency profile at {path}. Measure one on the target device with "
        f"`sb-profile --config <config.toml> --out {path}`, or explicitly request the "
        "FLOP-based analytic fallback."
    )


def block_pairs(lengths: np.ndarray, block_size: int) -> np.ndarray:
    """Causal block pairs of documents: n(n+1)/2 with n = ceil(L / block_size)."""
    n = np.ceil(np.asarray(lengths, dtype=np.float64) / block_size)
    return n * (n + 1) / 2


def forced_density(lengths: np.ndarray, block_size: int) -> np.ndarray:
    """Least possible density: the sink and diagonal blocks are always computed."""
    n = np.ceil(np.asarray(lengths, dtype=np.float64) / block_size)
    pairs = np.maximum(n * (n + 1) / 2, 1.0)
    return np.minimum(1.0, np.maximum(2 * n - 1, 1.0) / pairs)


def _lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """a + t*(b - a): exact where a == b, so flat stretches stay flat under rounding."""
    return a + t * (b - a)


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


# --------------------------------------------------------------------------- profile


def _number(value: Any, key: str, source: str) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value):
        raise ProfileError(f"{source}: key '{key}': expected a finite number, got {value!r}")
    if value < 0:
        raise ProfileError(f"{source}: key '{key}': must be >= 0, got {value!r}")
    return float(value)


def _integer(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProfileError(f"{source}: key '{key}': expected a positive integer, got {value!r}")
    return value


def _grid(value: Any, key: str, source: str, item) -> list:
    """A strictly increasing list of at least two entries."""
    if not isinstance(value, list) or len(value) < 2:
        raise ProfileError(f"{source}: key '{key}': expected a list of at least 2 entries")
    out = [item(v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise ProfileError(f"{source}: key '{key}': must be strictly increasing, got {out}")
    return out


def _row(value: Any, key: str, source: str, n: int) -> list[float]:
    if not isinstance(value, list) or len(value) != n:
        raise ProfileError(f"{source}: key '{key}': expected a list of {n} numbers")
    return [_number(v, f"{key}[{i}]", source) for i, v in enumerate(value)]


@dataclass
class Profile:
    """Measured latencies of one pipeline stage (or the whole model) on one device.

    attn_seconds[i][j]: fwd+bwd seconds of the stage's attention for ONE document of
    lengths[i] tokens at density densities[j] (marginal cost: measured on a micro-batch
    packed with copies of that document, divided by their count, so per-launch costs
    stay in `overhead_seconds`). linear_seconds[k]: fwd+bwd seconds of everything else
    for a micro-batch of linear_tokens[k] tokens, excluding the fixed overhead.
    """

    fingerprint: dict[str, Any]
    block_size: int
    lengths: list[int]
    densities: list[float]
    attn_seconds: list[list[float]]
    linear_tokens: list[int]
    linear_seconds: list[float]
    overhead_seconds: float
    source: str = field(default="<memory>", compare=False)

    def __post_init__(self) -> None:
        src = self.source
        if not isinstance(self.fingerprint, dict) or not all(
            isinstance(k, str) for k in self.fingerprint
        ):
            raise ProfileError(f"{src}: key 'fingerprint': expected an object with string keys")
        self.block_size = _integer(self.block_size, "block_size", src)
        self.lengths = _grid(self.lengths, "lengths", src, _integer)
        self.densities = _grid(self.densities, "densities", src, _number)
        if self.densities[0] <= 0 or self.densities[-1] != 1.0:
            raise ProfileError(f"{src}: key 'densities': must lie in (0, 1] and end at 1.0")
        if not isinstance(self.attn_seconds, list) or len(self.attn_seconds) != len(self.lengths):
            raise ProfileError(
                f"{src}: key 'attn_seconds': expected {len(self.lengths)} rows (one per length)"
            )
        self.attn_seconds = [
            _row(r, f"attn_seconds[{i}]", src, len(self.densities))
            for i, r in enumerate(self.attn_seconds)
        ]
        self.linear_tokens = _grid(self.linear_tokens, "linear_tokens", src, _integer)
        self.linear_seconds = _row(
            self.linear_seconds, "linear_seconds", src, len(self.linear_tokens)
        )
        self.overhead_seconds = _number(self.overhead_seconds, "overhead_seconds", src)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "fingerprint": self.fingerprint,
            "block_size": self.block_size,
            "lengths": self.lengths,
            "densities": self.densities,
            "attn_seconds": self.attn_seconds,
            "linear_tokens": self.linear_tokens,
            "linear_seconds": self.linear_seconds,
            "overhead_seconds": self.overhead_seconds,
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<memory>") -> Profile:
        if not isinstance(data, dict):
            raise ProfileError(f"{source}: expected a JSON object at the top level")
        keys = ("format", "version", "fingerprint", "block_size", "lengths", "densities")
        keys += ("attn_seconds", "linear_tokens", "linear_seconds", "overhead_seconds")
        for key in keys:
            if key not in data:
                raise ProfileError(f"{source}: missing key '{key}' (re-run `sb-profile`)")
        if data["format"] != PROFILE_FORMAT:
            raise ProfileError(f"{source}: key 'format': expected {PROFILE_FORMAT!r}")
        if data["version"] != PROFILE_VERSION:
            raise ProfileError(
                f"{source}: key 'version': expected {PROFILE_VERSION}, got {data['version']!r}"
            )
        return cls(**{k: data[k] for k in keys[2:]}, source=source)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically, so an interrupted profiler never leaves a truncated file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ProfileNotFoundError(missing_profile_message(path)) from None
        except UnicodeDecodeError as e:
            raise ProfileError(f"{path}: not a UTF-8 JSON profile ({e.reason})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(
                f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                "the file is corrupted or truncated, re-run `sb-profile`"
            ) from None
        return cls.from_dict(data, source=str(path))

    def digest(self) -> str:
        """Content hash: calibration state is only valid for the profile it was fit on."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()


@dataclass(frozen=True)
class AnalyticSpec:
    """Inputs of the FLOP-based model: one stage's dims and assumed device efficiencies.

    Defaults describe an H100/H200 SXM (989 TFLOP/s dense BF16). attn_efficiency is the
    block-sparse kernel's share of peak at any density (the ideal 1/rho speedup);
    gemm_efficiency the share reached by the projections and the MLP.
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int  # layers on this stage
    vocab_size: int = 0  # > 0: the stage holds the output projection
    block_size: int = 64
    peak_flops: float = 989e12
    gemm_efficiency: float = 0.6
    attn_efficiency: float = 0.4
    overhead_seconds: float = 1e-3
    device_name: str = "analytic"

    def __post_init__(self) -> None:
        dims = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "layers", "block_size")
        for name in dims:
            if getattr(self, name) < 1:
                raise ValueError(f"AnalyticSpec.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("gemm_efficiency", "attn_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"AnalyticSpec.{name} must lie in (0, 1]")
        if self.peak_flops <= 0 or self.overhead_seconds < 0 or self.vocab_size < 0:
            raise ValueError("AnalyticSpec: need peak_flops > 0, overhead_seconds >= 0, vocab >= 0")


_ANALYTIC_DENSITIES = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]


def analytic_profile(spec: AnalyticSpec) -> Profile:
    """A Profile computed from FLOPs instead of measured (explicit opt-in only)."""
    b = spec.block_size
    # Per causal block pair, head and layer: QK^T and PV forward (2 GEMMs) plus five
    # backward GEMMs (FlashAttention-2 recomputes S), 2 FLOPs per multiply-add.
    pair_flops = 14 * b * b * spec.head_dim * spec.heads * spec.layers
    attn_rate = spec.peak_flops * spec.attn_efficiency
    lengths = [b * 2**k for k in range(int(math.log2(131072 // b)) + 1)]
    pairs = block_pairs(np.array(lengths), b)
    attn = [[float(p * rho * pair_flops / attn_rate) for rho in _ANALYTIC_DENSITIES] for p in pairs]
    proj = spec.hidden * spec.head_dim * (2 * spec.heads + 2 * spec.kv_heads)
    params = spec.layers * (proj + 3 * spec.hidden * spec.intermediate)
    params += spec.vocab_size * spec.hidden
    gemm_rate = spec.peak_flops * spec.gemm_efficiency
    tokens = [2**k for k in range(10, 21)]
    fingerprint = {"source": "analytic", **asdict(spec)}
    return Profile(
        fingerprint=fingerprint,
        block_size=b,
        lengths=lengths,
        densities=list(_ANALYTIC_DENSITIES),
        attn_seconds=attn,
        linear_tokens=tokens,
        linear_seconds=[6.0 * params * t / gemm_rate for t in tokens],
        overhead_seconds=spec.overhead_seconds,
        source=f"analytic:{spec.device_name}",
    )


# --------------------------------------------------------------------- density model


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
        return _lerp(_lerp(t[i, j], t[i, j + 1], v), _lerp(t[i + 1, j], t[i + 1, j + 1], v), u)

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


# ------------------------------------------------------------------------ cost model


class BudgetSolution(NamedTuple):
    beta: float
    predicted_s: float
    clamped: int  # 0 reachable; -1 even beta_min is slower; +1 even beta_max is faster


class LatencyObservation(NamedTuple):
    doc_lens: Sequence[int]  # one micro-batch
    densities: float | Sequence[float]  # realised, scalar or per document
    seconds: float  # measured fwd+bwd of that micro-batch on this stage


@dataclass(frozen=True)
class _Batch:
    """Documents of several units, flattened once so each bisection step is vectorised."""

    lengths: np.ndarray  # [D]
    unit: np.ndarray  # [D] unit index of each document
    rows: np.ndarray  # [D, J] attention seconds at each profiled density
    forced: np.ndarray  # [D] least possible density
    rest: np.ndarray  # [U] unscaled overhead + linear seconds


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
    ) -> None:
        self.profile = profile
        self.density_model = density_model if density_model is not None else DensityModel()
        self.block_size = profile.block_size
        self.recall_model = RecallModel(block_size=self.block_size)  # DST's (dst.py)
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
        self._log_attn = np.log(np.maximum(mono, _MIN_SECONDS))
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
    def analytic(cls, spec: AnalyticSpec, **kwargs: Any) -> CostModel:
        return cls(analytic_profile(spec), **kwargs)

    @classmethod
    def from_file(
        cls, path: str | os.PathLike, *, analytic: AnalyticSpec | None = None, **kwargs: Any
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
        rows = np.exp(_lerp(self._log_attn[i], self._log_attn[i + 1], t))
        pairs = block_pairs(lengths, self.block_size)
        scale = np.where(lengths < self._lengths[0], pairs / self._edge_pairs[0], 1.0)
        scale = np.where(lengths > self._lengths[-1], pairs / self._edge_pairs[1], scale)
        return rows * scale[:, None]

    def _attn_at(self, rows: np.ndarray, rho: np.ndarray) -> np.ndarray:
        """Per-document seconds at density rho: linear between profiled densities."""
        rho = np.clip(rho, self._dens[0], self._dens[-1])
        j = np.clip(np.searchsorted(self._dens, rho, side="right") - 1, 0, len(self._dens) - 2)
        s = (rho - self._dens[j]) / (self._dens[j + 1] - self._dens[j])
        d = np.arange(len(rho))
        return _lerp(rows[d, j], rows[d, j + 1], s)

    def _linear(self, tokens: np.ndarray) -> np.ndarray:
        """Token-linear seconds: piecewise linear; proportional below, last slope above."""
        tok, lin = self._tokens, self._linear_s
        slope = (lin[-1] - lin[-2]) / (tok[-1] - tok[-2])
        out = np.interp(tokens, tok, lin)
        out = np.where(tokens < tok[0], lin[0] * tokens / tok[0], out)
        return np.where(tokens > tok[-1], lin[-1] + slope * (tokens - tok[-1]), out)

    def _batch(self, units: Sequence[Unit]) -> _Batch:
        lengths, unit_of_doc, mb_tokens, unit_of_mb = [], [], [], []
        for u, unit in enumerate(units):
            for mb in unit:
                lens = [int(x) for x in mb]
                if any(x < 0 for x in lens):
                    raise ValueError(f"document lengths must be >= 0, got {lens}")
                lengths += lens
                unit_of_doc += [u] * len(lens)
                mb_tokens.append(sum(lens))
                unit_of_mb.append(u)
        lengths_a = np.asarray(lengths, dtype=np.float64)
        tokens = np.asarray(mb_tokens, dtype=np.float64)
        mb_rest = self._overhead + self._linear(tokens)
        return _Batch(
            lengths=lengths_a,
            unit=np.asarray(unit_of_doc, dtype=np.int64),
            rows=self._attn_rows(lengths_a),
            forced=forced_density(lengths_a, self.block_size),
            rest=np.bincount(np.asarray(unit_of_mb, dtype=np.int64), mb_rest, len(units)),
        )

    def _unit_terms(self, batch: _Batch, rho: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([U] attention, [U] rest) unscaled seconds, given every document's density."""
        attn = np.bincount(batch.unit, self._attn_at(batch.rows, rho), len(batch.rest))
        return attn, batch.rest

    def _seconds(self, batch: _Batch, rho: np.ndarray) -> np.ndarray:
        attn, rest = self._unit_terms(batch, rho)
        return self.rest_scale * rest + self.attn_scale * attn

    def _rho(self, batch: _Batch, beta: np.ndarray, policy: str) -> np.ndarray:
        b = beta[batch.unit]
        rho = b if policy == "topk" else self.density_model.predict(b, batch.lengths)
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

    # -- prediction

    def predict(self, doc_lens: MicroBatch, density: float | Sequence[float]) -> float:
        """Seconds of one micro-batch with the given density (scalar or per document)."""
        attn, rest = self._terms(doc_lens, density)
        return self.rest_scale * rest + self.attn_scale * attn

    def density_for_budget(self, beta: float, length: int, policy: str) -> float:
        """Realised density of a document of `length` tokens at budget beta."""
        _check_policy(policy)
        batch = self._batch([[[length]]])
        return float(self._rho(batch, np.array([float(beta)]), policy)[0])

    def predict_units(
        self, units: Sequence[Unit], beta: float | Sequence[float], policy: str
    ) -> np.ndarray:
        """[U] seconds of each unit (sum over its micro-batches) at budget beta."""
        _check_policy(policy)
        batch = self._batch(units)
        betas = np.broadcast_to(np.asarray(beta, dtype=np.float64), (len(units),))
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
        _check_policy(policy)
        n = len(units)
        lo = np.broadcast_to(np.asarray(beta_min, dtype=np.float64), (n,)).copy()
        hi = np.broadcast_to(np.asarray(beta_max, dtype=np.float64), (n,)).copy()
        if not ((lo > 0) & (lo <= hi) & (hi <= 1)).all():
            raise ValueError(f"need 0 < beta_min <= beta_max <= 1, got {beta_min}, {beta_max}")
        target = np.broadcast_to(np.asarray(targets_s, dtype=np.float64), (n,))
        batch = self._batch(units)
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
        return [
            BudgetSolution(float(x), float(p), int(c))
            for x, p, c in zip(beta, pred, clamped, strict=True)
        ]

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
        xs, zs = [], []
        for doc_lens, densities, seconds in observations:
            seconds = float(seconds)
            if not (math.isfinite(seconds) and seconds > 0):
                continue
            attn, rest = self._terms(doc_lens, densities)
            xs.append(attn / seconds)
            zs.append(rest / seconds)
        if not xs:
            return
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

    def check_fingerprint(self, expected: dict[str, Any], strict: bool = False) -> list[str]:
        """Keys of `expected` whose profile value differs; warn, or raise under strict."""
        have = {**self.profile.fingerprint, "block_size": self.profile.block_size}
        missing = object()
        diffs = [k for k in sorted(expected) if have.get(k, missing) != expected[k]]
        if diffs:
            detail = "; ".join(
                f"{k}: profile={have.get(k, '<missing>')!r} current={expected[k]!r}" for k in diffs
            )
            msg = f"{self.profile.source}: profile fingerprint mismatch: {detail}"
            if strict:
                raise ProfileError(msg)
            logger.warning(msg)
        return diffs

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


# -- configuration ([cost_model]) ---------------------------------------------------

ANALYTIC_DEVICES: dict[str, dict[str, float]] = {
    # Dense BF16 peak; efficiencies are assumptions (docs/cost_model.md), not measurements.
    "h100": {"peak_flops": 989e12, "gemm_efficiency": 0.6, "attn_efficiency": 0.4},
    "h200": {"peak_flops": 989e12, "gemm_efficiency": 0.62, "attn_efficiency": 0.42},
    # One CPU core in fp32: a rough order of magnitude, for wiring tests only.
    "cpu": {"peak_flops": 5e10, "gemm_efficiency": 0.5, "attn_efficiency": 0.2},
}


@dataclass(kw_only=True, slots=True)
class CostModelConfig:
    """The `[cost_model]` section."""

    profile: str | None = None
    """A `sb-profile` JSON measured on this device for this model and stage split."""
    analytic_device: str | None = None
    """Explicit opt-in FLOP model instead of (or when missing) a profile: h100, h200, cpu."""
    strict_fingerprint: bool = False
    """A profile measured on another device/software/model is an error, not a warning."""
    refit: bool = True
    """Recalibrate online from measured micro-batch times (identical on every rank)."""
    drift_threshold: float = 0.15
    """Warn when the prediction error's moving average exceeds this fraction."""

    def __post_init__(self) -> None:
        if self.analytic_device is not None and self.analytic_device not in ANALYTIC_DEVICES:
            raise ValueError(
                f"cost_model.analytic_device: {self.analytic_device!r} is not one of "
                f"{sorted(ANALYTIC_DEVICES)}"
            )


def analytic_spec(
    device: str,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    layers: int,
    vocab_size: int = 0,
    block_size: int = 64,
) -> AnalyticSpec:
    return AnalyticSpec(
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        layers=layers,
        vocab_size=vocab_size,
        block_size=block_size,
        device_name=f"analytic-{device}",
        **ANALYTIC_DEVICES[device],
    )


def analytic_stage_spec(
    dims: Any, layers: int, head: bool, device: str, block_size: int
) -> AnalyticSpec:
    """The analytic spec of one pipeline stage of a model with Qwen2.5-style `dims`
    (dim, n_heads, n_kv_heads, head_dim, hidden_dim, vocab_size); `head`: the stage
    holds the output projection."""
    return analytic_spec(
        device,
        hidden=dims.dim,
        heads=dims.n_heads,
        kv_heads=dims.n_kv_heads,
        head_dim=dims.head_dim,
        intermediate=dims.hidden_dim,
        layers=max(layers, 1),
        vocab_size=dims.vocab_size if head else 0,
        block_size=block_size,
    )


def build_cost_model(
    config: CostModelConfig, spec_for: Callable[[str], AnalyticSpec], expected: dict[str, Any]
) -> CostModel | None:
    """The run's cost model, or None when neither a profile nor the analytic fallback
    was configured (callers that need one say which command makes it)."""
    fallback = spec_for(config.analytic_device) if config.analytic_device else None
    if config.profile is None:
        return CostModel.analytic(fallback) if fallback is not None else None
    model = CostModel.from_file(config.profile, analytic=fallback)
    if model.profile.source != "<memory>":
        model.check_fingerprint(expected, strict=config.strict_fingerprint)
    return model
