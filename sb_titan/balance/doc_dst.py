"""Per-document DST: each document of a micro-batch gets its own budget, within the time
the micro-batch's DST budget costs (`[dst] per_document`).

Micro-batch DST (dst.py) decides one budget per micro-batch. Its time target here is
what that budget costs: the predicted attention seconds of the micro-batch's documents
at it (the rest of a micro-batch's time does not depend on budgets). Within it,
`doc_budgets.DocAllocator` picks each document's budget for the most predicted
token-weighted recall, from curves the cost model gives every document alone: attention
seconds (`CostModel.document_seconds`) and recall (`cost_model.recall_model`, as DST
predicts a step's recall) over a grid of budgets plus the micro-batch's own, so an
equal split at the micro-batch's budget is always a candidate and the allocation never
predicts less recall in the same time.

A document whose sample was trained before carries its measured recall in the plan
(`MicroBatchPlan.recalls`, `[dst] doc_history`). Its sensitivity then scales its curve:
at every budget it loses the mass the recall model predicts for its length, times the
ratio it lost to the predicted loss at the budget it trained with (to the power of the
measurement's weight, so a few sampled blocks move it little). So a document that lost
twice what the model expected gains twice the recall per step of budget, and the
allocation gives it budget first: a constant shift of the curve would change no
document's marginal recall.

With the `recall` anchor, micro-batch DST already holds the step's predicted recall at
beta0's; the recall per-document budgets add is then taken back as time: every
micro-batch's target is the same share of its attention seconds, the lowest share (a
fixed sequence of tries, `_lowest_scale`) whose allocation still predicts beta0's
recall for the step.

A pure function of the shared plan, the micro-batch budgets and the cost model, so every
rank decides the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from sb_titan.balance.cost_model import CostModel
from sb_titan.balance.doc_budgets import DocAllocator, DocBudgetConfig
from sb_titan.balance.dst import DSTConfig, DSTDecision, sensitive_tokens
from sb_titan.balance.sab import MicroBatchPlan, StepPlan

GRID = tuple(k / 100 for k in range(1, 101))  # budgets a document may take (and its own)
_SCALE_STEPS = 12  # the recall anchor's share is found to 2**-12 of the attention time
_LOSS_FLOOR = 1e-3  # lost mass below this counts as this: a ratio of two near-zero
# losses says nothing, and would scale a document's curve without bound


class DocDecision(NamedTuple):
    """A step's per-document budgets and what they are predicted to keep."""

    budgets: list[list[list[float]]]  # [dp rank][micro-batch][document in doc_lens order]
    attending_tokens: float  # tokens of documents of >= 2 tokens
    recalled_tokens: float  # predicted recalled tokens at these budgets
    scale: float  # share of each micro-batch's attention seconds its target is (1 but `recall`)

    @property
    def predicted_recall(self) -> float:
        return self.recalled_tokens / self.attending_tokens if self.attending_tokens else 1.0

    def rows(self, plan: StepPlan, dp: int, mb: int) -> list[list[float]]:
        """Micro-batch (dp, mb)'s budgets per row ([b][d]: row b's document d), as
        `attention.layout.block_budgets` takes them; a row without documents (all
        padding) takes the micro-batch's last budget."""
        flat = iter(self.budgets[dp][mb])
        out = [[next(flat) for _ in row] for row in plan.microbatches[dp][mb].rows]
        last = self.budgets[dp][mb][-1:] or [1.0]
        return [row or last for row in out]


class _StepCurves:
    """Every document of a step at every grid budget and at its micro-batch's budget,
    predicted in one vectorised call per budget."""

    def __init__(
        self,
        plan: StepPlan,
        budgets: list[list[float]],
        model: CostModel,
        cfg: DSTConfig,
        policy: str,
    ) -> None:
        mbs = [mb for rank in plan.microbatches for mb in rank]
        self.shape = [len(rank) for rank in plan.microbatches]
        self.lengths = np.array([n for mb in mbs for n in mb.doc_lens], dtype=np.int64)
        counts = [len(mb.doc_lens) for mb in mbs]
        self.bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.own = np.array([b for rank in budgets for b in rank], dtype=np.float64)
        own_doc = np.repeat(self.own, counts)
        self.grid = np.array([g for g in GRID if cfg.beta_min <= g <= cfg.beta_max])
        self.history = self._history(mbs, model) if cfg.learns_doc_history else None
        cols = [*self.grid, own_doc]  # the last column: each document at its micro-batch's
        self.seconds = np.stack(
            [model.document_seconds(self.lengths, g, policy) for g in cols], axis=1
        )
        self.recall = np.stack([self.recall_at(model, g) for g in cols], axis=1)

    def _history(self, mbs: list[MicroBatchPlan], model: CostModel) -> np.ndarray | None:
        """[D] how sensitive each document's last measured recall says it is: the mass
        its sensitive tokens lost at the budget it trained with over what the recall
        model predicts they lose there, to the power of the measurement's weight (1 for
        documents never measured). None when no document of the step was."""
        seen = [mb.recalls or [[math.nan] * 3] * len(mb.doc_lens) for mb in mbs]
        rows = np.array([r for mb in seen for r in mb], dtype=np.float64).reshape(-1, 3)
        known = ~np.isnan(rows[:, 0])
        if not known.any():
            return None
        beta, kept, weight = rows[known].T
        predicted = model.recall_model.predict(beta, self.lengths[known].astype(np.float64))
        lost = np.maximum(1.0 - kept, _LOSS_FLOOR) / np.maximum(1.0 - predicted, _LOSS_FLOOR)
        out = np.ones(self.lengths.size)
        out[known] = lost**weight
        return out

    def recall_at(self, model: CostModel, beta: float | np.ndarray) -> np.ndarray:
        """Predicted recall of each document: its first two blocks keep everything, the
        rest what the recall model predicts (dst.recalled_tokens, per document),
        corrected by the document's own history where it has one."""
        length = self.lengths.astype(np.float64)
        sensitive = sensitive_tokens(length, model.block_size)
        kept = model.recall_model.predict(beta, length) if length.size else length
        if self.history is not None:  # it loses what the model says, scaled by its history
            kept = np.clip(1.0 - (1.0 - kept) * self.history, 0.0, 1.0)
        return np.where(length >= 2, (length - sensitive + sensitive * kept) / length, 1.0)

    def microbatch(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(grid, seconds [D, K], recall [D, K], the column of its own budget) of
        micro-batch i, both curves made non-decreasing over the grid."""
        lo, hi = self.bounds[i], self.bounds[i + 1]
        beta = self.own[i]
        k = int(np.searchsorted(self.grid, beta))
        skip = k + int(k < self.grid.size and self.grid[k] == beta)
        grid = np.concatenate([self.grid[:k], [beta], self.grid[skip:]])

        def curve(table: np.ndarray) -> np.ndarray:
            rows = table[lo:hi]
            merged = np.concatenate([rows[:, :k], rows[:, -1:], rows[:, skip:-1]], axis=1)
            return np.maximum.accumulate(merged, axis=1)

        return grid, curve(self.seconds), curve(self.recall), k


def step_doc_budgets(
    plan: StepPlan,
    budgets: list[list[float]],
    decision: DSTDecision | None,
    model: CostModel,
    cfg: DSTConfig,
    policy: str,
) -> DocDecision:
    """Per-document budgets of a step whose micro-batch budgets are `budgets` ([dp
    rank][micro-batch], from `decision`), for the selection `policy`."""
    curves = _StepCurves(plan, budgets, model, cfg, policy)
    bounds = DocBudgetConfig(
        grid=tuple(sorted({cfg.beta_min, cfg.beta_max})),  # checks only: each has its own
        beta_min=cfg.beta_min,
        beta_max=cfg.beta_max,
        long_tokens=cfg.long_tokens,
        long_floor=cfg.long_floor,
    )
    tables, targets = [], []
    for i in range(curves.own.size):
        grid, seconds, recall, own = curves.microbatch(i)
        lengths = curves.lengths[curves.bounds[i] : curves.bounds[i + 1]]
        tables.append((grid, seconds, recall, lengths))
        targets.append(math.fsum(seconds[:, own].tolist()))
    allocators = DocAllocator.many(tables, bounds)

    def at(scale: float) -> tuple[list[np.ndarray], float]:
        got = [a(t * scale) for a, t in zip(allocators, targets, strict=True)]
        recalled = [g.recall * a.weight.sum() for g, a in zip(got, allocators, strict=True)]
        return [g.betas for g in got], math.fsum(recalled)

    scale = 1.0
    betas, recalled = at(scale)
    if cfg.enabled and cfg.anchor == "recall" and decision is not None:
        static = decision.recalled_tokens_static
        if curves.history is not None:  # beta0's recall as the same curves predict it
            weight = np.where(curves.lengths >= 2, curves.lengths, 0)
            static = (weight * curves.recall_at(model, cfg.beta0)).tolist()
        need = math.fsum(static) * (1 - 1e-12)
        scale, betas, recalled = _lowest_scale(at, need, scale, betas, recalled)
    flat = iter(b.tolist() for b in betas)
    nested = [[next(flat) for _ in range(n)] for n in curves.shape]
    attending = float(np.where(curves.lengths >= 2, curves.lengths, 0).sum())
    return DocDecision(nested, attending, recalled, scale)


def _lowest_scale(
    at: Callable[[float], tuple[list[np.ndarray], float]],
    need: float,
    scale: float,
    betas: list[np.ndarray],
    recalled: float,
) -> tuple[float, list[np.ndarray], float]:
    """The lowest share of the targets (on a 2**-_SCALE_STEPS grid below 1) whose
    allocation still predicts `need` recalled tokens, with it: micro-batch DST's recall
    anchor already holds the step at beta0's recall, so what is to spare is what
    per-document budgets add, and the share lies close to 1. So the search gallops down
    from 1 (1 - 2**-12, 1 - 2**-11, ...) and bisects the last gap, a fixed sequence of
    shares (identical on every rank) that costs two allocations where nothing is to
    spare."""
    gap = 2.0**-_SCALE_STEPS
    while gap <= 0.5 and (found := at(1.0 - gap))[1] >= need:
        scale, (betas, recalled) = 1.0 - gap, found
        gap *= 2
    lo = 1.0 - gap  # the first share that kept too little (0: every one down to 0.5 kept)
    while scale - lo > 2.0**-_SCALE_STEPS:
        mid = 0.5 * (lo + scale)
        if (found := at(mid))[1] >= need:
            scale, (betas, recalled) = mid, found
        else:
            lo = mid
    return scale, betas, recalled
