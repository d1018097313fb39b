"""DST: workload-aware dynamic sparsity tuning.

Each step, every work unit (a DP rank's micro-batches, or one PP micro-batch) is
predicted at the default budget beta0; units predicted above anchor*(1+p) get the
budget whose predicted latency is the anchor (sparser, never below beta_min), units
below anchor*(1-p) get the budget whose predicted latency is the anchor (denser, never
above beta_max). A pure function of the plan and the cost model, so every rank that
holds the same plan and the same synchronised cost model decides the same budgets.

The anchor is a statistic of the predicted latencies (the paper's min/mean/median/max)
or `recall`: the lowest latency target at which the step's predicted recall is not
below beta0's. A budget only changes the attention of query tokens past the first two
blocks of their document (sink and diagonal are always kept); the mass such tokens
keep at budget beta is `cost_model.recall_model` (at least beta under both policies,
plus an overshoot: a uniform-mass prior and a correction learned online from the
recall the trainer measures; sb_titan/recall_model.py). Time-balancing alone
(the mean anchor) moves equal seconds, which buy fewer recall points on a unit of
short documents (already near 1) than they cost on a unit of long ones; `recall`
stops where the trade is even.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from sb_titan.balance.cost_model import POLICIES, CostModel, Unit, UnitBatch
from sb_titan.balance.cost_model.recall import RECALL_MEASURES, RecallMeasure

Anchor = Literal["min", "mean", "median", "max", "recall"]  # the CLI help lists them
ANCHORS: tuple[str, ...] = get_args(Anchor)
RECALL_BETA_KNOTS = 20  # the recall model's budget knots with [dst] recall_by_budget
_ANCHOR_BISECT_STEPS = 40  # fixed (identical on every rank); on the table, so cheap
_TABLE_POINTS = 16  # grid intervals on each side of beta0 in the recall table
_REFINE_ROUNDS = 6  # exact checks of the recall anchor before falling back to max


@dataclass(kw_only=True, slots=True)
class DSTConfig:
    """The `[dst]` section."""

    enabled: bool = True
    """Off: every unit trains at beta0 (predictions are still made, for logging)."""
    anchor: Anchor = "mean"
    """What to pull the units' predicted latencies toward (min, mean, median or max of
    them, or `recall`). The paper
    found mean best and min harmful; `recall` is the fastest target that keeps the
    step's predicted recall at beta0's (accuracy-neutral)."""
    p: float = 0.1
    """Tolerance: units within anchor*(1 +/- p) keep beta0."""
    beta0: float = 0.9
    """Default budget."""
    beta_min: float = 0.5
    """Floor for bottlenecks (accuracy guard)."""
    beta_max: float = 1.0
    """Ceiling for non-bottlenecks."""
    recall_measure: RecallMeasure = "top_key"
    """What the `recall` anchor holds and DST's recall model learns: `top_key` (the share
    of sampled queries whose key of greatest true probability was kept), `true` recall
    (their exact kept mass, attention/recall.py) or the estimator's own `estimated`
    recall, which cannot see a block the estimator misjudges. `top_key` is the default by
    measurement: across selections at equal density on the accuracy base it orders
    held-out exact match (0.84 -> 27%, 0.93 -> 63%), where true recall stayed within
    0.70-0.77 for all of them (docs/attention.md)."""
    recall_by_budget: bool = False
    """Learn the recall model by budget as well as by length (RecallModel's budget knots,
    every 0.05): measured curves rise with the budget at a slope that differs with
    length, which one correction per length cannot follow, and per-document budgets
    trade recall across lengths (docs/results.md, "Per-document budgets"). Off: one
    correction per length, as before (the recorded plan digests)."""
    verify_ranks: bool = False
    """Debug: all-gather a hash of the step's budgets and fail if any rank disagrees."""
    per_document: bool = False
    """Also give every document of a micro-batch its own budget (balance/doc_dst.py):
    within the time the micro-batch's budget costs, the budgets with the most predicted
    recall (attention time grows with a document's square length, so long documents
    cost many seconds per point of recall). With the `recall` anchor the time that buys
    is taken back as speed, down to the step's predicted recall at beta0. Off: every
    document trains at its micro-batch's budget, as before."""
    long_tokens: int = 16384
    """Per-document budgets: documents of at least this many tokens are long and get at
    least `long_floor` (recall per second favours starving exactly the long-range
    documents that long-context training is for)."""
    long_floor: float = 0.5
    """Per-document budgets: the lowest budget of a long document."""
    doc_history: bool = True
    """Per-document budgets: credit each document with the recall its own sampled
    queries measured (true recall or top-key hits, as `recall_measure` says) and, the
    next time its sample is planned, correct the recall model's curve for it by what it
    missed or beat the model by (SAB's per-sample densities, for recall). Off, or with
    the `estimated` measure: a document's predicted recall depends on its length alone."""
    doc_history_blocks: float = 8.0
    """Per-document budgets: how many sampled query blocks a document's own measurement
    needs to count as much as the recall model's prediction for its length (its weight
    is b / (b + doc_history_blocks) for b sampled blocks)."""

    @property
    def learns_doc_history(self) -> bool:
        """Whether documents are credited with their own measured recall."""
        return self.per_document and self.doc_history and self.recall_measure != "estimated"

    @property
    def recall_beta_knots(self) -> int:
        """The recall model's budget knots (0: by length only)."""
        return RECALL_BETA_KNOTS if self.recall_by_budget else 0

    def __post_init__(self) -> None:
        if self.anchor not in ANCHORS:
            raise ValueError(f"dst.anchor must be one of {ANCHORS}, got {self.anchor!r}")
        if self.recall_measure not in RECALL_MEASURES:
            raise ValueError(
                f"dst.recall_measure must be one of {RECALL_MEASURES}, got {self.recall_measure!r}"
            )
        if not (math.isfinite(self.p) and self.p >= 0):
            raise ValueError(f"dst.p must be a finite number >= 0, got {self.p!r}")
        for name in ("beta_min", "beta0", "beta_max"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value <= 1):
                raise ValueError(f"dst.{name} must lie in (0, 1], got {value!r}")
        if self.long_tokens < 1 or not 0 < self.long_floor <= self.beta_max:
            raise ValueError(
                f"dst: need long_tokens >= 1 and 0 < long_floor <= beta_max, got "
                f"{self.long_tokens}, {self.long_floor} (beta_max {self.beta_max})"
            )
        half = self.doc_history_blocks
        if not (math.isfinite(half) and half > 0):
            raise ValueError(f"dst.doc_history_blocks must be a finite number > 0, got {half!r}")
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
    attending_tokens: list[float]  # per unit: tokens of documents of >= 2 tokens
    recalled_tokens: list[float]  # per unit: predicted mass kept, in tokens, at budgets
    recalled_tokens_static: list[float]  # per unit: the same at beta0

    @property
    def predicted_recall(self) -> float:
        """The step's predicted token-mean recall at the chosen budgets."""
        return _ratio(self.recalled_tokens, self.attending_tokens)

    @property
    def predicted_recall_static(self) -> float:
        """The same with every unit at beta0: what DST is compared against."""
        return _ratio(self.recalled_tokens_static, self.attending_tokens)

    def digest(self) -> str:
        """Stable hash of the budget vector: ranks compare it to prove they agree."""
        return hashlib.sha1(np.asarray(self.budgets, dtype="<f8").tobytes()).hexdigest()

    @property
    def imbalance_before(self) -> float:
        return _imbalance(self.predicted_before)

    @property
    def imbalance_after(self) -> float:
        return _imbalance(self.predicted_after)


def _ratio(num: Sequence[float], den: Sequence[float]) -> float:
    total = math.fsum(den)
    return math.fsum(num) / total if total > 0 else 1.0


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


def sensitive_tokens(lengths: np.ndarray | float, block_size: int) -> np.ndarray:
    """Query tokens past their document's first two blocks (documents block-aligned):
    the budget-sensitive ones; the first two blocks keep everything at any budget."""
    return np.maximum(0.0, lengths - 2 * block_size)


def recalled_tokens(
    units: Sequence[Unit], beta: float | Sequence[float], cost_model: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """([U] attending tokens, [U] predicted recalled tokens) at a budget per unit.

    Attending tokens are those of documents of >= 2 tokens (what the trainer's recall
    averages over); the first two blocks of a document keep all their mass, the rest
    `recall_model(beta, L)` of it.
    """
    lengths = np.asarray([float(n) for unit in units for mb in unit for n in mb])
    unit_of = np.asarray([u for u, unit in enumerate(units) for mb in unit for _ in mb])
    docs = _Docs(lengths, unit_of.astype(np.int64), len(units), cost_model)
    return docs.attending_u, docs.recalled(beta)


class _Docs:
    """A step's documents for the recall prediction, with everything that does not
    depend on the budget computed once."""

    def __init__(
        self, lengths: np.ndarray, unit: np.ndarray, n_units: int, cost_model: CostModel
    ) -> None:
        self.unit, self.n_units, self.model = unit, n_units, cost_model.recall_model
        attending = np.where(lengths > 1, lengths, 0.0)
        self.sensitive = sensitive_tokens(lengths, cost_model.block_size)
        self.base = attending - self.sensitive
        self.attending_u = np.bincount(unit, attending, n_units)
        self.rows = self.model.length_rows(lengths) if lengths.size else None

    def recalled(self, beta: float | Sequence[float]) -> np.ndarray:
        """[U] predicted recalled tokens at a budget per unit."""
        if self.rows is None:
            return np.zeros(self.n_units)
        betas = np.broadcast_to(np.asarray(beta, dtype=np.float64), (self.n_units,))
        kept = self.model.predict_rows(self.rows, betas, self.unit)
        return np.bincount(self.unit, self.base + self.sensitive * kept, self.n_units)


def sensitive_recall(
    doc_lens: Sequence[int], recall: float, block_size: int
) -> tuple[int, float] | None:
    """Invert the model for one measured micro-batch: (its longest document, the mass
    kept by its budget-sensitive tokens), or None if it has none. This is what the
    trainer feeds `cost_model.recall_model`."""
    lengths = np.asarray([float(n) for n in doc_lens if n > 1])
    sensitive = float(sensitive_tokens(lengths, block_size).sum())
    if sensitive <= 0:
        return None
    attending = float(lengths.sum())
    kept = (recall * attending - (attending - sensitive)) / sensitive
    return int(lengths.max()), min(1.0, max(kept, 1e-6))


def _budgets_at(
    batch: UnitBatch,
    cost_model: CostModel,
    cfg: DSTConfig,
    policy: str,
    before: np.ndarray,
    anchor: float,
) -> tuple[np.ndarray, np.ndarray, int]:
    """(budgets, predicted seconds, clamped count) with every unit pulled toward anchor."""
    budgets = np.full(batch.n_units, cfg.beta0)
    after = before.copy()
    n_clamped = 0
    slow = before > anchor * (1 + cfg.p)
    fast = before < anchor * (1 - cfg.p)
    idx = np.flatnonzero(slow | fast)
    if idx.size:
        # Bottlenecks search [beta_min, beta0], the rest [beta0, beta_max]: a unit is
        # never pushed the wrong way.
        beta, seconds, clamped = cost_model.solve_budgets(
            batch.subset(idx),
            anchor,
            policy,
            beta_min=np.where(slow[idx], cfg.beta_min, cfg.beta0),
            beta_max=np.where(slow[idx], cfg.beta0, cfg.beta_max),
        )
        budgets[idx], after[idx] = beta, seconds
        n_clamped = int((clamped != 0).sum())
    return budgets, after, n_clamped


class _RecallTable:
    """Every unit's predicted seconds and recalled tokens at a fixed grid of budgets
    (beta_min .. beta0 .. beta_max, beta0 a grid point), built with one vectorised
    prediction per grid point. Between grid points both are interpolated linearly, so
    the recalled tokens a unit keeps when pulled to an anchor are a lookup on its row:
    a whole step's recall at any anchor costs O(units x grid), no re-prediction."""

    def __init__(
        self,
        batch: UnitBatch,
        docs: _Docs,
        cost_model: CostModel,
        cfg: DSTConfig,
        policy: str,
        before: np.ndarray,
        static: np.ndarray,
    ) -> None:
        low = np.linspace(cfg.beta_min, cfg.beta0, _TABLE_POINTS + 1)
        high = np.linspace(cfg.beta0, cfg.beta_max, _TABLE_POINTS + 1)[1:]
        grid = np.concatenate([low, high])
        n = batch.n_units
        mid = _TABLE_POINTS  # beta0's column: `before` and `static`, already predicted
        seconds = [
            before if k == mid else cost_model.predict_batch(batch, g, policy)
            for k, g in enumerate(grid)
        ]
        recalled = [static if k == mid else docs.recalled(g) for k, g in enumerate(grid)]
        self.seconds = np.maximum.accumulate(np.stack(seconds, axis=1), axis=1)  # [U, G]
        self.recalled = np.stack(recalled, axis=1)
        self.before, self.static, self.p = before, static, cfg.p
        self._rows = np.arange(n)

    def recalled_at(self, anchor: float) -> float:
        """The step's recalled tokens (interpolated) with every unit pulled to anchor."""
        t, r, rows = self.seconds, self.recalled, self._rows
        # Largest grid column within the anchor; a slow unit's lies left of beta0's
        # column, a fast unit's right of it (its row passes through `before` there).
        k = np.clip((t <= anchor).sum(axis=1) - 1, 0, t.shape[1] - 2)
        lo, hi = t[rows, k], t[rows, k + 1]
        span = hi - lo
        frac = np.where(
            span > 0,
            np.clip((anchor - lo) / np.where(span > 0, span, 1.0), 0.0, 1.0),
            (hi <= anchor).astype(np.float64),
        )
        moved = r[rows, k] + frac * (r[rows, k + 1] - r[rows, k])
        band = (self.before <= anchor * (1 + self.p)) & (self.before >= anchor * (1 - self.p))
        return math.fsum(np.where(band, self.static, moved).tolist())

    def lowest_anchor(self, need: float) -> float:
        """Fixed-step bisection on the table (cheap: no re-prediction) for the lowest
        anchor whose interpolated recall reaches need."""
        lo, hi = float(self.before.min()), float(self.before.max())
        if self.recalled_at(lo) >= need:
            return lo
        for _ in range(_ANCHOR_BISECT_STEPS):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if self.recalled_at(mid) >= need else (mid, hi)
        return hi


def _recall_neutral_budgets(
    batch: UnitBatch,
    docs: _Docs,
    cost_model: CostModel,
    cfg: DSTConfig,
    policy: str,
    before: np.ndarray,
    static: np.ndarray,
) -> tuple[float, tuple[np.ndarray, np.ndarray, int]]:
    """The lowest anchor whose budgets keep the predicted recalled tokens at beta0's,
    and those budgets.

    Budgets only rise with the anchor, and at max(before) nobody is lowered, so the
    condition is monotone and holds at the top. The anchor is searched on the
    interpolated `_RecallTable`, then its budgets are solved exactly and their recall
    checked exactly; if interpolation was optimistic the anchor steps up (doubling
    steps from 2**-13 of the range, a few rounds, then max(before), which always keeps
    recall). So the recall guarantee is exact; the anchor's excess over the exact edge
    is the table's interpolation error (or the last step).
    """
    need = math.fsum(static.tolist()) * (1 - 1e-12)
    table = _RecallTable(batch, docs, cost_model, cfg, policy, before, static)
    lo, top = float(before.min()), float(before.max())
    anchor = table.lowest_anchor(need)
    for k in range(_REFINE_ROUNDS):
        if k:  # interpolation was optimistic (typically at a unit leaving the band)
            anchor = min(top, anchor + (top - lo) * 2.0 ** (k - 14))
        solved = _budgets_at(batch, cost_model, cfg, policy, before, anchor)
        if math.fsum(docs.recalled(solved[0]).tolist()) >= need:
            return anchor, solved
    return top, _budgets_at(batch, cost_model, cfg, policy, before, top)


def tune_budgets(
    units: Sequence[Unit], cost_model: CostModel, cfg: DSTConfig, policy: str = "mass"
) -> DSTDecision:
    """Budgets per unit that pull every predicted latency toward the anchor; `policy` is
    the selection policy the budgets feed ([sparse_attention] policy)."""
    if not units or any(len(unit) == 0 for unit in units):
        raise ValueError("tune_budgets: need at least one unit, each with >= 1 micro-batch")
    if policy not in POLICIES:
        raise ValueError(f"tune_budgets: policy must be one of {POLICIES}, got {policy!r}")
    batch = cost_model.prepare(units)
    n = batch.n_units
    before = cost_model.predict_batch(batch, cfg.beta0, policy)
    docs = _Docs(batch.lengths, batch.unit, n, cost_model)
    attending, static = docs.attending_u, docs.recalled(cfg.beta0)
    if not cfg.enabled:  # the anchor is only logged
        anchor = _anchor(before, "mean" if cfg.anchor == "recall" else cfg.anchor)
        budgets, after, n_clamped = np.full(n, cfg.beta0), before.copy(), 0
    elif cfg.anchor == "recall":
        anchor, (budgets, after, n_clamped) = _recall_neutral_budgets(
            batch, docs, cost_model, cfg, policy, before, static
        )
    else:
        anchor = _anchor(before, cfg.anchor)
        budgets, after, n_clamped = _budgets_at(batch, cost_model, cfg, policy, before, anchor)
    return DSTDecision(
        budgets=budgets.tolist(),
        anchor_s=anchor,
        predicted_before=before.tolist(),
        predicted_after=after.tolist(),
        n_raised=int((budgets > cfg.beta0).sum()),
        n_lowered=int((budgets < cfg.beta0).sum()),
        n_clamped=int(n_clamped),
        attending_tokens=attending.tolist(),
        recalled_tokens=docs.recalled(budgets).tolist(),
        recalled_tokens_static=static.tolist(),
    )
