"""Recall scored with measured per-document curves that the allocator never saw
(`sb-simulate --recall-curves`).

Without it, a simulated step's recall is what DST and per-document DST predicted: the
allocator graded by its own model. With it, measured curves (bench/recall_curves.py:
per document, true recall and top-key hit at each budget) are split in two halves of
different documents. The `fit` half is what DST's recall model learns from, as a trainer
learns from the documents it trained; the `heldout` half scores every simulated
document at the budget it was given: the mean held-out curve of its length, linear in
the budget and in log2 length between the measured lengths (clamped outside them).
A step's held-out recall is the token-weighted mean over its attending documents, as
the trainer's recall counts tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sb_titan.balance.cost_model.recall import RecallModel
from sb_titan.balance.dst import DSTConfig, sensitive_recall

FORMAT = "sb_titan.recall_curves"
SCORED = ("true", "top_key")  # what the held-out half scores


@dataclass(frozen=True)
class RecallCurves:
    """Per-document curves at the budgets `betas`: the held-out half as mean curves per
    measured length, the fit half document by document."""

    betas: np.ndarray  # [K], increasing
    lengths: np.ndarray  # [C] measured lengths, increasing
    heldout: dict[str, np.ndarray]  # measure -> [C, K] held-out mean curve per length
    fit: list[tuple[int, dict[str, np.ndarray]]]  # (length, measure -> [K]) per document

    @classmethod
    def load(cls, path: str | Path) -> RecallCurves:
        """Read bench/recall_curves.py's JSON; ValueError naming the file and what is
        wrong otherwise."""
        try:
            rep = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read recall curves ({e})") from e
        if not isinstance(rep, dict) or rep.get("format") != FORMAT:
            raise ValueError(f"{path}: not a recall-curves file (format {FORMAT!r} expected)")
        betas = np.asarray(rep.get("betas", []), dtype=np.float64)
        if betas.size < 2 or (np.diff(betas) <= 0).any() or betas[0] <= 0 or betas[-1] > 1:
            raise ValueError(f"{path}: 'betas' must be >= 2 increasing budgets in (0, 1]")
        measures = ("estimated", *SCORED)
        halves: dict[str, dict[int, list[dict[str, np.ndarray]]]] = {"fit": {}, "heldout": {}}
        for i, doc in enumerate(rep.get("documents", [])):
            doc = doc if isinstance(doc, dict) else {}
            half, length = doc.get("half"), doc.get("length")
            curves = {m: np.asarray(doc.get(m, []), dtype=np.float64) for m in measures}
            if (
                half not in halves
                or not isinstance(length, int)
                or length < 1
                or any(c.shape != betas.shape for c in curves.values())
                or any(
                    not np.isfinite(c).all() or (c < 0).any() or (c > 1).any()
                    for c in curves.values()
                )
            ):
                raise ValueError(
                    f"{path}: document {i} needs 'half' fit/heldout, an integer 'length' >= 1 "
                    f"and {', '.join(measures)} in [0, 1] at each of the {betas.size} budgets"
                )
            halves[half].setdefault(length, []).append(curves)
        if not halves["fit"] or not halves["heldout"]:
            raise ValueError(f"{path}: needs documents in both halves, fit and heldout")
        lengths = np.array(sorted(halves["heldout"]), dtype=np.int64)
        heldout = {
            m: np.stack([np.mean([d[m] for d in halves["heldout"][n]], axis=0) for n in lengths])
            for m in SCORED
        }
        fit = [(n, d) for n in sorted(halves["fit"]) for d in halves["fit"][n]]
        return cls(betas, lengths, heldout, fit)

    def fitted_model(self, dst: DSTConfig, block_size: int) -> RecallModel:
        """DST's recall model (its measure, by budget or not) after learning the fit half
        at the budgets DST may give (beta_min .. beta_max): what a trainer would have
        observed, one document at a time, inverted to its budget-sensitive tokens as the
        trainer inverts it."""
        measure = dst.recall_measure
        model = RecallModel(
            block_size=block_size, measure=measure, beta_knots=dst.recall_beta_knots
        )
        used = (self.betas >= dst.beta_min) & (self.betas <= dst.beta_max)
        observations = []
        for length, curves in self.fit:
            for beta, recall in zip(self.betas[used], curves[measure][used], strict=True):
                got = sensitive_recall([length], float(recall), block_size)
                if got is not None:
                    observations.append((float(beta), got[0], got[1]))
        model.update(observations)
        return model

    def score(
        self, lengths: Sequence[int] | np.ndarray, betas: Sequence[float] | np.ndarray
    ) -> dict[str, float]:
        """Held-out recall per scored measure of documents `lengths` at budgets `betas`
        (one each): the token-weighted mean over attending documents (>= 2 tokens)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        weight = np.where(lengths >= 2, lengths, 0.0)
        if weight.sum() == 0:
            return dict.fromkeys(SCORED, 1.0)
        return {
            m: float((weight * self.per_document(lengths, betas, m)).sum() / weight.sum())
            for m in SCORED
        }

    def per_document(
        self,
        lengths: Sequence[int] | np.ndarray,
        betas: Sequence[float] | np.ndarray,
        measure: str = "true",
    ) -> np.ndarray:
        """Each document's held-out `measure` at its budget: the mean held-out curve of
        its length, linear in the budget and in log2 length between measured lengths."""
        lengths = np.asarray(lengths, dtype=np.float64)
        betas = np.asarray(betas, dtype=np.float64)
        x = np.log2(np.clip(lengths, self.lengths[0], self.lengths[-1]))
        knots = np.log2(self.lengths.astype(np.float64))
        if len(knots) == 1:
            lo = hi = np.zeros(lengths.size, dtype=np.int64)
            u = np.zeros(lengths.size)
        else:
            hi = np.clip(np.searchsorted(knots, x), 1, len(knots) - 1)
            lo = hi - 1
            u = (x - knots[lo]) / (knots[hi] - knots[lo])
        at = np.stack([np.interp(betas, self.betas, curve) for curve in self.heldout[measure]])
        cols = np.arange(lengths.size)
        return (1 - u) * at[lo, cols] + u * at[hi, cols]
