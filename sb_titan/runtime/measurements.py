"""One step's measurements from every rank, keyed by (DP rank, micro-batch): what the
trainer all-gathers and then turns, identically on every rank, into cost-model refits,
SAB observations and the balance scalars it logs.

They travel as one fixed-size float64 tensor per rank (encode/decode below), so a step
costs one tensor all-gather, not a pickle per rank: float64 holds every value exactly
(Python floats, small integers, fp32 stats), so decoded measurements equal the local
ones bit for bit and every rank refits identically."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from sb_titan.attention.selection import STATS_FIELDS, STATS_SIZE
from sb_titan.balance.cost_model import LatencyObservation
from sb_titan.balance.dst import sensitive_recall
from sb_titan.balance.sab import StepPlan

_HEADER = 5  # dp, pp, cp, step_seconds, micro-batches per step
_ROW = 3 + STATS_SIZE  # timed?, seconds, stats?, then the stats in STATS_FIELDS order
_SAMPLED = slice(STATS_FIELDS.index("true_recall_sum"), STATS_SIZE)


def measurement_size(microbatches: int) -> int:
    """Length of one rank's encoded measurements for a step of `microbatches`."""
    return _HEADER + _ROW * microbatches


def encode_measurements(local: dict, microbatches: int) -> torch.Tensor:
    """One rank's measurements ({"dp", "pp", "seconds", "stats", "step_seconds"}, and "cp"
    under context parallelism: absent means 0) as a
    float64 vector of measurement_size(microbatches). A micro-batch this rank did not time
    or has no stats for is flagged absent (a PP stage or rank sees only some)."""
    rows = [[0.0] * _ROW for _ in range(microbatches)]

    def row(mb: int) -> list[float]:
        if not 0 <= mb < microbatches:
            raise ValueError(f"micro-batch {mb}: expected 0..{microbatches - 1}")
        return rows[mb]

    for mb, s in local["seconds"].items():
        row(mb)[0:2] = [1.0, s]
    for mb, v in local["stats"].items():
        if len(v) != STATS_SIZE:
            raise ValueError(f"micro-batch {mb} stats: expected {STATS_SIZE} values, got {len(v)}")
        row(mb)[2:_ROW] = [1.0, *v]
    header = [local["dp"], local["pp"], local.get("cp", 0), local["step_seconds"], microbatches]
    flat = [float(x) for x in header] + [x for row in rows for x in row]
    return torch.tensor(flat, dtype=torch.float64)


def decode_measurements(gathered: torch.Tensor, microbatches: int) -> list[dict]:
    """Every rank's measurements from the all-gathered vectors (world x size, any shape
    that flattens to it), in the form StepMeasurements.from_gathered takes."""
    size = measurement_size(microbatches)
    flat = gathered.detach().reshape(-1).cpu().tolist()
    if len(flat) % size:
        raise ValueError(f"gathered measurements: {len(flat)} values, not a multiple of {size}")
    out = []
    for at in range(0, len(flat), size):
        dp, pp, cp, step_seconds, n = flat[at : at + _HEADER]
        if n != microbatches:
            raise ValueError(f"rank sent {n:g} micro-batches per step, expected {microbatches}")
        rows = [flat[i : i + _ROW] for i in range(at + _HEADER, at + size, _ROW)]
        out.append(
            {
                "dp": int(dp),
                "pp": int(pp),
                "cp": int(cp),
                "seconds": {mb: r[1] for mb, r in enumerate(rows) if r[0]},
                "stats": {mb: r[3:_ROW] for mb, r in enumerate(rows) if r[2]},
                "step_seconds": step_seconds,
            }
        )
    return out


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

    @classmethod
    def from_gathered(cls, gathered: list[dict], plan: StepPlan, budgets) -> StepMeasurements:
        seconds: dict[tuple[int, int], float] = {}
        rank_compute: dict[tuple[int, int], float] = {}
        sums: dict[tuple[int, int], list[float]] = {}
        cp_kept: dict[tuple[int, int], dict[int, float]] = {}
        for g in sorted(gathered, key=lambda g: (g["dp"], g["pp"], g.get("cp", 0))):
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
        return cls(seconds, rank_compute, step, density, recall, budgets, pp, kept, sampled)

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

    def sample_densities(self, plan: StepPlan) -> tuple[list[int], list[float]]:
        ids, dens = [], []
        for (dp, mb), rho in sorted(self.density.items()):
            for row in plan.microbatches[dp][mb].rows:
                for piece in row:
                    ids.append(piece.sample_id)
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


def all_gather_flat(x: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `x`, concatenated in rank order: one collective on gloo and NCCL
    (gloo takes only the flat output form; NCCL needs `x` on the rank's device)."""
    out = x.new_empty(dist.get_world_size() * x.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x)
    return out
