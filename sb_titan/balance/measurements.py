"""One step's measurements from every rank, keyed by (DP rank, micro-batch), and what
the balancer learns from them: latency observations for the cost-model refit, densities
and recalls for its density and recall models and for SAB, and the balance scalars the
trainer logs. The trainer gathers them (runtime/measurements.py); every rank holds the
same, so every rank learns identically."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sb_titan.attention.selection import BLOCK_FIELDS, STATS_FIELDS, STATS_SIZE
from sb_titan.balance.cost_model import LatencyObservation
from sb_titan.balance.dst import sensitive_recall, sensitive_tokens
from sb_titan.balance.sab import StepPlan

_SAMPLED = slice(STATS_FIELDS.index("true_recall_sum"), STATS_SIZE)
_KEPT, _ALLOWED = BLOCK_FIELDS.index("kept_blocks"), BLOCK_FIELDS.index("allowed_blocks")


@dataclass
class StepMeasurements:
    """One step's measurements from every rank, keyed by (DP rank, micro-batch)."""

    seconds: dict[tuple[int, int], float]  # slowest stage's fwd+bwd time
    rank_compute: dict[tuple[int, int], float]  # (dp, pp) -> summed compute seconds
    step_seconds: float
    density: dict[tuple[int, int], float]
    recall: dict[tuple[int, int], tuple[float, float]]  # (token-weighted sum, tokens)
    budgets: list[list[float]]
    pp_degree: int = 1
    cp_kept: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    """(dp, mb) -> each CP rank's share of the micro-batch's kept block pairs (its
    density partial sums: the same denominator on every CP rank of a row)."""
    sampled: dict[tuple[int, int], tuple[float, float, float]] = field(default_factory=dict)
    """(dp, mb) -> (true recall sum, top-key hits, sampled pairs) of its sampled queries."""
    doc_sums: dict[tuple[int, int], list[tuple[float, ...]]] = field(default_factory=dict)
    """(dp, mb) -> for each of its documents in `doc_lens` order, the sums of its query
    blocks in selection.BLOCK_FIELDS order (sampled true recall, top-key hits, pairs,
    kept and allowed key blocks; the trainer credits a query block to the document of
    its first token)."""
    doc_budgets: list[list[list[float]]] | None = None
    """[dp][mb][document] budgets under per-document DST (None: the micro-batch's)."""
    sample_rate: float = 1.0
    """The share of query blocks whose queries were sampled (true_recall_rate)."""

    @classmethod
    def from_gathered(
        cls,
        gathered: list[dict],
        plan: StepPlan,
        budgets,
        doc_budgets: list[list[list[float]]] | None = None,
        sample_rate: float = 1.0,
    ) -> StepMeasurements:
        seconds: dict[tuple[int, int], float] = {}
        rank_compute: dict[tuple[int, int], float] = {}
        sums: dict[tuple[int, int], list[float]] = {}
        cp_kept: dict[tuple[int, int], dict[int, float]] = {}
        docs: dict[tuple[int, int], np.ndarray] = {}
        for g in sorted(gathered, key=lambda g: (g["dp"], g["pp"], g.get("cp", 0))):
            for mb, values in g.get("doc_sums", {}).items():  # stages and shards add
                key = (g["dp"], int(mb))
                docs[key] = docs.get(key, 0.0) + np.asarray(values, dtype=np.float64)
            cp = g.get("cp", 0)
            stage = (g["dp"], g["pp"])  # CP ranks of a stage wait for each other: max
            rank_compute[stage] = max(rank_compute.get(stage, 0.0), sum(g["seconds"].values()))
            for mb, s in g["seconds"].items():
                key = (g["dp"], int(mb))
                seconds[key] = max(seconds.get(key, 0.0), s)
            for mb, values in g["stats"].items():  # STATS_FIELDS order
                key = (g["dp"], int(mb))
                acc = sums.setdefault(key, [0.0] * STATS_SIZE)
                for i, v in enumerate(values):
                    acc[i] += v
                per_cp = cp_kept.setdefault(key, {})
                per_cp[cp] = per_cp.get(cp, 0.0) + values[0]
        # CP shards' fp32 partial densities can sum past 1 by rounding
        density = {k: min(1.0, v[0] / v[1]) for k, v in sums.items() if v[1] > 0}
        recall = {k: (v[2], v[3]) for k, v in sums.items() if v[1] > 0}
        step = max(g["step_seconds"] for g in gathered)
        pp = 1 + max(g["pp"] for g in gathered)
        kept = {k: [v[r] for r in sorted(v)] for k, v in cp_kept.items() if len(v) > 1}
        sampled = {k: tuple(v[_SAMPLED]) for k, v in sums.items() if v[_SAMPLED][-1] > 0}
        doc_sums = {
            k: [tuple(row) for row in v.tolist()]
            for k, v in docs.items()
            if v.size and v[:, _ALLOWED].any()
        }
        return cls(
            seconds, rank_compute, step, density, recall, budgets, pp, kept, sampled,
            doc_sums, doc_budgets, sample_rate,
        )  # fmt: skip

    def observations(self, plan: StepPlan) -> list[LatencyObservation]:
        out = []
        for (dp, mb), s in sorted(self.seconds.items()):
            lens = plan.microbatches[dp][mb].doc_lens
            rho = self.density.get((dp, mb), 1.0)
            out.append(LatencyObservation(lens, [rho] * len(lens), s))
        return out

    def density_observations(self, plan: StepPlan) -> list[tuple[float, int, float]]:
        """(budget, length, density) per micro-batch, the density attributed to its
        longest document (it holds most of the causal block pairs)."""
        out = []
        for (dp, mb), rho in sorted(self.density.items()):
            lens = plan.microbatches[dp][mb].doc_lens
            if lens:
                out.append((self.budgets[dp][mb], max(lens), rho))
        return out

    def recall_observations(
        self, plan: StepPlan, block_size: int, measure: str = "estimated"
    ) -> list[tuple[float, int, float]]:
        """(budget, length, kept mass of budget-sensitive tokens) per micro-batch, for
        DST's recall model (dst.sensitive_recall inverts the measured recall): estimated
        recall over attending tokens, or true recall or top-key hits over the sampled
        queries (sampled uniformly over query blocks: their mean estimates the token mean)."""
        if measure == "true":
            measured = {k: (s, n) for k, (s, _, n) in self.sampled.items()}
        elif measure == "top_key":
            measured = {k: (h, n) for k, (_, h, n) in self.sampled.items()}
        else:
            measured = self.recall
        out = []
        for (dp, mb), (kept, tokens) in sorted(measured.items()):
            if tokens > 0:
                lens = plan.microbatches[dp][mb].doc_lens
                obs = sensitive_recall(lens, kept / tokens, block_size)
                if obs is not None:
                    out.append((self.budgets[dp][mb], *obs))
        return out

    def document_recalls(
        self, plan: StepPlan, block_size: int, measure: str, half_blocks: float
    ) -> tuple[list[int], np.ndarray]:
        """(sample ids, rows [budget, kept mass, weight]) of the documents whose own
        sampled queries were measured: the budget it trained with (its own under
        per-document budgets, else its micro-batch's), the mass its budget-sensitive
        tokens kept (dst.sensitive_recall of its own recall, true or top-key hits as
        `measure` says; estimated recall is not measured per document), and the weight
        of so few samples against the recall model: b / (b + half_blocks) for the b
        query blocks its sensitive tokens span, sampled at `sample_rate`."""
        ids: list[int] = []
        rows: list[list[float]] = []
        field = 1 if measure == "top_key" else 0
        for (dp, mb), sums in sorted(self.doc_sums.items()):
            pieces = [p for row in plan.microbatches[dp][mb].rows for p in row]
            own = self.doc_budgets[dp][mb] if self.doc_budgets is not None else None
            for d, (piece, values) in enumerate(zip(pieces, sums, strict=True)):
                if values[2] <= 0:
                    continue
                got = sensitive_recall([piece.length], values[field] / values[2], block_size)
                if got is None:  # no budget-sensitive tokens: nothing a budget changes
                    continue
                blocks = self.sample_rate * sensitive_tokens(piece.length, block_size) / block_size
                budget = own[d] if own is not None else self.budgets[dp][mb]
                ids.append(piece.sample_id)
                rows.append([budget, got[1], blocks / (blocks + half_blocks)])
        return ids, np.asarray(rows, dtype=np.float64).reshape(-1, 3)

    def sample_densities(self, plan: StepPlan) -> tuple[list[int], list[float]]:
        """(sample ids, densities) for SAB: each document's own (its query blocks' kept
        over allowed key blocks) where the trainer credited documents, else its
        micro-batch's."""
        ids, dens = [], []
        for (dp, mb), rho in sorted(self.density.items()):
            pieces = [p for row in plan.microbatches[dp][mb].rows for p in row]
            own = self.doc_sums.get((dp, mb)) or [None] * len(pieces)
            for piece, sums in zip(pieces, own, strict=True):
                ids.append(piece.sample_id)
                if sums is not None and sums[_ALLOWED] > 0:
                    dens.append(min(1.0, sums[_KEPT] / sums[_ALLOWED]))
                else:
                    dens.append(rho)
        return ids, dens

    def unit_seconds_flat(self) -> list[float]:
        return [s for _, s in sorted(self.seconds.items())]

    def _excess_over_balanced(self) -> float:
        """Seconds the step lost to uneven work: the critical path minus the same
        path with every unit at the mean. Without PP the critical path is the slowest
        rank's compute; under 1F1B-like schedules it is ~ sum of the slowest stage's
        micro-batch times plus (p - 1) of the largest (warm-up and cool-down)."""
        per_dp: dict[int, list[float]] = {}
        for (dp, _), s in sorted(self.seconds.items()):
            per_dp.setdefault(dp, []).append(s)
        excess = []
        for times in per_dp.values():
            t = np.asarray(times)
            p = self.pp_degree
            excess.append((t.sum() + (p - 1) * t.max()) - (len(t) + p - 1) * t.mean())
        rank_sums = [sum(t) for t in per_dp.values()]
        dp_excess = max(rank_sums) - float(np.mean(rank_sums))
        return float(max(excess) + dp_excess)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        mb_times = np.asarray(self.unit_seconds_flat())
        if len(mb_times):
            out["balance/microbatch_imbalance"] = float(mb_times.max() / mb_times.mean())
        per_dp: dict[int, float] = {}
        for (dp, _), s in self.seconds.items():
            per_dp[dp] = per_dp.get(dp, 0.0) + s
        if per_dp:
            v = np.asarray(list(per_dp.values()))
            out["balance/rank_imbalance"] = float(v.max() / v.mean())
            out["balance/rank_compute_max_s"] = float(v.max())
            out["balance/rank_compute_mean_s"] = float(v.mean())
        if self.step_seconds > 0 and self.rank_compute:
            busy = np.asarray(list(self.rank_compute.values())) / self.step_seconds
            out["balance/bubble_share"] = float(np.clip(1.0 - busy, 0.0, 1.0).mean())
        if len(mb_times) and per_dp:
            out["balance/step_s"] = self.step_seconds  # what ideal_step_s is cut from
            out["balance/microbatch_max_s"] = float(mb_times.max())
            out["balance/microbatch_mean_s"] = float(mb_times.mean())
            out["balance/ideal_step_s"] = self.step_seconds - self._excess_over_balanced()
        if self.cp_kept:  # what each CP rank computed, from the real selection tables
            ratios = [max(v) / np.mean(v) for v in self.cp_kept.values() if np.mean(v) > 0]
            if ratios:
                out["balance/cp_kept_imbalance"] = float(np.mean(ratios))
                out["balance/cp_kept_imbalance_max"] = float(np.max(ratios))
        if self.density:
            out["sparsity/density"] = float(np.mean(list(self.density.values())))
            # Over attending tokens of the whole step (padding excluded), so a padded
            # plan and a full one compare on the same footing.
            kept, tokens = np.sum(list(self.recall.values()), axis=0)
            out["sparsity/recall"] = float(kept / tokens) if tokens > 0 else 1.0
        if self.sampled:  # over the step's sampled (query, head) pairs
            true_sum, hits, n = np.sum(list(self.sampled.values()), axis=0)
            out["sparsity/true_recall"] = float(true_sum / n)
            out["sparsity/top_key_hit"] = float(hits / n)
        return out
