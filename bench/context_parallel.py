"""Context-parallel split quality on real selection tables.

How evenly do the CP ranks' attention loads come out, under the dense zigzag split and
under the trainer's sparse-aware split (`document_split`: every rank an equal predicted
share of every document), on packed longtail-v1 rows of 256K tokens?

Setup (fixed, printed and written to bench/results/context_parallel.json):
* Rows: longtail-v1 documents packed into rows of R = 262144 tokens by the trainer's
  own planner (`sab.Planner`, policy `sequential`: documents in data order, rows cut
  at document boundaries, padding at the end of a row). Block 64 (NB = 4096).
* Kept pairs per query block come from the real `select_blocks` (policy `mass`, the
  PyTorch estimator, chunked over query blocks) on the q/k of every layer, summed over
  kv heads. Two sources of q/k, both stated in the output:
  - `model`: Qwen2.5 `debug4` (4 layers, 4 q / 2 kv heads, head dim 64) at random
    init (no trained base is available here), RoPE cache grown to R; each layer's
    post-RoPE q/k of random tokens, positions restarting per document. The attention
    output is replaced by zeros to make a 256K forward affordable on a CPU, so a layer's
    input is the embedding plus the MLPs above it. Random-init q/k give near-uniform
    block masses: selection keeps about beta of the blocks (little real sparsity).
  - `synthetic`: per layer and kv head, block-constant q/k whose pooled scores are
    alpha * hot[j] + gamma * cos(omega (i - j)) + noise: a few "hot" key blocks per
    document (each block with probability p, plus the document's first block), a
    local window, and noise. The model's parameters, fixed per (layer, head): alpha in
    [4, 7], p log-uniform in [0.5%, 5%], gamma in [1, 4], omega = 2 pi / 64 blocks;
    the hot positions and the noise are drawn per row. This is real sparsity: density
    falls with document length, differently per head and layer.
  - `dense`: every allowed pair (the trainer's dense layers, e.g. layer 0).
* Predicted cost per query block, learned online from *other* rows (fit rows: shorter,
  another seed; never the rows scored), two predictors:
  - `density`: `predicted_block_pairs` with the cost model's DensityModel updated as the
    trainer updates it (per row: budget, longest document, row density as a mean over
    layers);
  - `profile`: `BlockProfile`, the mean kept count per query block as a function of the
    blocks it may see, from the same fit tables.
* Per (source, budget, CP degree): the split (zigzag; the trainer's `document_split` on
  the predictor; `lpt`: blocks packed by predicted cost alone, heaviest first) is one
  per row for every layer; imbalance = max / mean over CP ranks of the rank's kept
  pairs (predicted: of the predicted cost; computed: of the kept pairs each rank's query
  blocks actually computed in each layer's table), the worst row; per layer and over
  all layers (sum of per-layer maxima / sum of means). Two reference splits beside
  them: `oracle` (LPT on the computed tables themselves) and `doc density`
  (LPT on rho_d x n with each document's own measured density: what per-document
  history would give). The foreign blocks' diagonal pair cp_attention adds is the same
  count on every rank, so it is left out (it only lowers imbalance).

    python bench/context_parallel.py [--quick]  ->  bench/results/context_parallel.json
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import platform
import time
from pathlib import Path

import numpy as np
import torch

from sb_titan.attention.layout import AttnMeta, doc_ids_from_lengths
from sb_titan.attention.selection import select_blocks
from sb_titan.balance.cost_model import DensityModel
from sb_titan.balance.sab import AnalyticCost, Planner, SABConfig
from sb_titan.context_parallel.split import (
    CPSplit,
    allowed_blocks,
    document_split,
    imbalance,
    predicted_block_pairs,
    rank_loads,
    zigzag_split,
)
from sb_titan.data.longtail import longtail_v1

OUT = Path(__file__).resolve().parent / "results" / "context_parallel.json"
BLOCK = 64
SOURCES = ("model", "synthetic")
BAR = 1.05


@dataclasses.dataclass
class Setup:
    row_len: int = 262144
    rows: int = 4
    fit_row_len: int = 65536
    fit_rows: int = 4
    degrees: tuple[int, ...] = (2, 4, 8)
    budgets: tuple[float, ...] = (0.9, 0.5)
    seed: int = 0
    fit_seed: int = 1
    flavor: str = "debug4"


QUICK = Setup(row_len=16384, rows=2, fit_row_len=8192, fit_rows=2, degrees=(2, 4))


# -- rows


def pack_rows(row_len: int, rows: int, seed: int) -> list[list[int]]:
    """Document lengths of `rows` rows, packed as the trainer's loader packs them."""
    lengths = longtail_v1(max(64, 40 * rows), row_len, seed)
    planner = Planner(
        lengths,
        seq_len=row_len,
        dp=1,
        microbatches=rows,
        rows_per_microbatch=1,
        config=SABConfig(policy="sequential", seed=seed),
        cost_fn=AnalyticCost(row_len),
    )
    return [mb.doc_lens for mb in planner.next_step().microbatches[0]]


# -- q/k sources: each yields (layer, q [1, Hq, L, D], k [1, Hkv, L, D]) for one row


def model_qk(flavor: str, doc_id: torch.Tensor, seed: int):
    """Post-RoPE q/k of every layer of a random-init model, attention output zeroed."""
    from sb_titan.eval.checkpoint import build_model
    from sb_titan.models.attention import SparseAttentionConfig
    from sb_titan.models.qwen2_5 import FLAVORS

    L = doc_id.shape[1]
    torch.manual_seed(seed)
    dims = dataclasses.replace(FLAVORS[flavor], max_seq_len=L)
    model = build_model(dims, SparseAttentionConfig(), flavor)
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Capture(torch.nn.Module):
        def forward(self, q, k, v, **_):
            captured.append((q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()))
            return torch.zeros_like(q)

    for layer in model.layers.values():
        layer.attention.inner_attention = Capture()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, dims.vocab_size, (1, L), generator=g)
    start = torch.ones_like(doc_id, dtype=torch.bool)
    start[:, 1:] = doc_id[:, 1:] != doc_id[:, :-1]
    pos = torch.arange(L).expand_as(doc_id)
    positions = pos - torch.cummax(torch.where(start, pos, 0), dim=1).values
    meta = AttnMeta(doc_id.to(torch.int32), torch.ones(1))
    model._skip_lm_head = True
    with torch.no_grad():
        model(tokens, positions=positions, attention_masks=meta)
    yield from ((i, q, k) for i, (q, k) in enumerate(captured))


SYN_LAYERS, SYN_KV_HEADS, SYN_GROUP, SYN_DIM = 4, 2, 2, 64
SYN_MODEL_SEED = 1234  # the synthetic model's per-(layer, head) parameters


def synthetic_qk(doc_id: torch.Tensor, seed: int):
    """Block-constant q/k whose pooled scores are alpha hot[j] + gamma cos(w(i-j)) + noise.
    (alpha, gamma, p) per (layer, head) are the model's (fixed, SYN_MODEL_SEED); the hot
    positions and the noise are the row's (`seed`)."""
    L = doc_id.shape[1]
    nb = L // BLOCK
    scale = SYN_DIM**-0.5
    first = torch.ones(nb, dtype=torch.bool)
    first[1:] = doc_id[0, ::BLOCK][1:] != doc_id[0, ::BLOCK][:-1]
    omega = 2 * math.pi / 64
    i = torch.arange(nb, dtype=torch.float32)
    for layer in range(SYN_LAYERS):
        model = np.random.default_rng([SYN_MODEL_SEED, layer])
        rng = np.random.default_rng([seed, layer])
        qs, ks = [], []
        for _ in range(SYN_KV_HEADS):
            alpha, gamma = model.uniform(4, 7), model.uniform(1, 4)
            p = math.exp(model.uniform(math.log(0.005), math.log(0.05)))
            hot = torch.from_numpy(rng.random(nb) < p) | first
            q = torch.from_numpy(rng.normal(0, 0.7, (nb, SYN_DIM))).float()
            k = torch.from_numpy(rng.normal(0, 0.7, (nb, SYN_DIM))).float()
            q[:, 0], k[:, 0] = alpha / scale, hot.float()
            c = math.sqrt(gamma / scale)
            q[:, 1], q[:, 2] = c * torch.cos(omega * i), c * torch.sin(omega * i)
            k[:, 1], k[:, 2] = c * torch.cos(omega * i), c * torch.sin(omega * i)
            qs += [q] * SYN_GROUP
            ks.append(k)
        q = torch.stack(qs).repeat_interleave(BLOCK, dim=1)[None]  # [1, Hq, L, D]
        k = torch.stack(ks).repeat_interleave(BLOCK, dim=1)[None]
        yield layer, q, k


def kept_tables(source: str, setup: Setup, doc_id: torch.Tensor, seed: int) -> np.ndarray:
    """[layers, budgets, NB] kept key blocks per query block (sum over kv heads) of one
    row, and [NB] kv heads (for per-head means)."""
    qk = model_qk(setup.flavor, doc_id, seed) if source == "model" else synthetic_qk(doc_id, seed)
    out = []
    for _, q, k in qk:
        per_budget = []
        for beta in setup.budgets:
            table, _ = select_blocks(q, k, doc_id, beta, policy="mass", block_size=BLOCK)
            per_budget.append(table.kv_count[0].sum(0).numpy())
        out.append(per_budget)
        heads = k.shape[1]
    return np.asarray(out, dtype=np.float64), heads


# -- predictors, fitted on the fit rows


# Kept key blocks per query block, learned from observed block tables.
#
# `predicted_block_pairs` prices a query block from a per-document density rho(L): the
# growth of rho(n Bs) n(n+1)/2 from n - 1 to n visible blocks. That is exact when the
# density model is, but the trainer learns rho from one number per micro-batch (its
# density, attributed to its longest document), so the shape in n is a prior, not data.
#
# `BlockProfile` learns the shape itself: the mean kept count (over kv heads) of the query
# blocks that may see n key blocks, on log2 n bins, straight from the tables selection
# returns. Under causal attention a query block's kept count depends on what it may see,
# not on its document's final length, so n is the natural variable; the profile is what a
# split needs (a cost per query block) with nothing in between.


class BlockProfile:
    """c_hat(beta, n): predicted kept key blocks of a query block that may see n blocks.

    Per budget knot (beta rounded to 1/beta_knots) and log2 n bin, running sums of n and
    of the kept count; a prediction interpolates linearly between the bins' (mean n,
    mean count) points, through (0, 0) below the first, along the last segment above
    the last (a profile that grows linearly in n stays linear). Budgets without
    observations use the nearest observed knot. Predictions are clipped to [1, n] (the
    diagonal is always kept, nothing beyond n)."""

    def __init__(self, *, beta_knots: int = 20, max_log2_n: int = 24) -> None:
        if beta_knots < 1 or max_log2_n < 1:
            raise ValueError("BlockProfile: need beta_knots >= 1 and max_log2_n >= 1")
        self.beta_knots = beta_knots
        shape = (beta_knots + 1, max_log2_n + 1)
        self.count = np.zeros(shape, dtype=np.float64)
        self.sum_n = np.zeros(shape, dtype=np.float64)
        self.sum_kept = np.zeros(shape, dtype=np.float64)

    def _knot(self, beta: float) -> int:
        return int(np.clip(np.rint(float(beta) * self.beta_knots), 0, self.beta_knots))

    def _bin(self, n: np.ndarray) -> np.ndarray:
        return np.clip(np.floor(np.log2(np.maximum(n, 1))), 0, self.count.shape[1] - 1)

    def update(self, beta: float, allowed: np.ndarray, kept: np.ndarray) -> None:
        """allowed: blocks each query block may see; kept: its kept blocks (mean over kv
        heads), same shape. Padding blocks (n = 1) count like any other."""
        n = np.asarray(allowed, dtype=np.float64).ravel()
        c = np.asarray(kept, dtype=np.float64).ravel()
        if n.shape != c.shape:
            raise ValueError(f"BlockProfile.update: {n.shape} allowed vs {c.shape} kept")
        k, b = self._knot(beta), self._bin(n).astype(np.int64)
        size = self.count.shape[1]
        self.count[k] += np.bincount(b, minlength=size)
        self.sum_n[k] += np.bincount(b, n, minlength=size)
        self.sum_kept[k] += np.bincount(b, c, minlength=size)

    def observed(self, beta: float) -> bool:
        return bool(self.count[self._knot(beta)].any())

    def predict(self, beta: float, allowed: np.ndarray) -> np.ndarray:
        """Predicted kept blocks per query block (same shape as `allowed`)."""
        seen = np.flatnonzero(self.count.any(axis=1))
        if not len(seen):
            raise ValueError("BlockProfile.predict: nothing observed yet")
        k = int(seen[np.argmin(np.abs(seen - self._knot(beta)))])
        live = self.count[k] > 0
        xs = self.sum_n[k, live] / self.count[k, live]
        ys = self.sum_kept[k, live] / self.count[k, live]
        xs, ys = np.concatenate([[0.0], xs]), np.concatenate([[0.0], ys])
        n = np.asarray(allowed, dtype=np.float64)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        out = np.where(n > xs[-1], ys[-1] + slope * (n - xs[-1]), np.interp(n, xs, ys))
        return np.clip(out, 1.0, np.maximum(n, 1.0))


def fit_predictors(source: str, setup: Setup) -> tuple[DensityModel, BlockProfile, dict]:
    rows = pack_rows(setup.fit_row_len, setup.fit_rows, setup.fit_seed)
    doc_id = doc_ids_from_lengths(rows, setup.fit_row_len)
    density, profile = DensityModel(), BlockProfile()
    densities = {beta: [] for beta in setup.budgets}
    for b, lens in enumerate(rows):
        kept, heads = kept_tables(source, setup, doc_id[b : b + 1], setup.fit_seed + b)
        allowed = allowed_blocks(doc_id[b : b + 1], BLOCK)[0].astype(np.float64)
        for j, beta in enumerate(setup.budgets):
            per_layer = kept[:, j].sum(-1) / (allowed.sum() * heads)
            rho = float(per_layer.mean())  # the trainer's statistic: mean over layers
            density.update([(beta, max(lens), rho)])
            densities[beta].append(rho)
            for layer_kept in kept[:, j]:
                profile.update(beta, allowed, layer_kept / heads)
    return density, profile, {str(k): float(np.mean(v)) for k, v in densities.items()}


# -- scoring


def lpt_split(cost: np.ndarray, degree: int, block_size: int) -> CPSplit:
    """The reference partition (what the package shipped before `document_split`):
    cost [B, NB] (work per query block) -> the split that gives each rank
    NB / N blocks of every row: heaviest block first to the least-loaded rank with room,
    then swaps between the most- and least-loaded ranks while they lower the maximum.
    Deterministic (stable orders, ties to the lower rank), so every rank of a CP group
    computes the same split from the same costs."""
    cost = np.asarray(cost, dtype=np.float64)
    B, nb = cost.shape
    if nb % degree:
        raise ValueError(f"{nb} blocks do not split evenly over {degree} CP ranks")
    per = nb // degree
    blocks = np.empty((B, degree, per), dtype=np.int64)
    for b in range(B):
        owner = _greedy(cost[b], degree, per)
        _swap_down(cost[b], owner, degree)
        for r in range(degree):
            blocks[b, r] = np.flatnonzero(owner == r)
    return CPSplit(torch.from_numpy(blocks), block_size)


def _greedy(cost: np.ndarray, degree: int, per: int) -> np.ndarray:
    heap = [(0.0, r) for r in range(degree)]  # (load, rank) of ranks with room
    filled = [0] * degree
    owner = np.empty(len(cost), dtype=np.int64)
    for i in np.argsort(-cost, kind="stable"):
        load, r = heapq.heappop(heap)
        owner[i] = r
        filled[r] += 1
        if filled[r] < per:
            heapq.heappush(heap, (load + float(cost[i]), r))
    return owner


def _swap_down(cost: np.ndarray, owner: np.ndarray, degree: int, rounds: int = 64) -> None:
    """Swap one block of the most-loaded rank with one of the least-loaded rank, the
    pair whose difference is closest to half their gap, while that lowers the larger."""
    for _ in range(rounds):
        load = np.bincount(owner, weights=cost, minlength=degree)
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        a = np.flatnonzero(owner == hi)
        c = np.flatnonzero(owner == lo)
        c = c[np.argsort(cost[c], kind="stable")]
        # for each block of hi, the block of lo with cost nearest cost[a] - gap / 2
        want = cost[a] - gap / 2
        at = np.clip(np.searchsorted(cost[c], want), 1, len(c)) - 1
        best = None
        for j in (at, np.minimum(at + 1, len(c) - 1)):
            d = cost[a] - cost[c[j]]
            new_max = np.maximum(load[hi] - d, load[lo] + d)
            k = int(np.argmin(new_max))
            if d[k] > 0 and new_max[k] < load[hi] - 1e-12 * load[hi]:
                if best is None or new_max[k] < best[0]:
                    best = (new_max[k], a[k], c[j[k]])
        if best is None:
            return
        owner[best[1]], owner[best[2]] = lo, hi


def worst(loads: np.ndarray) -> float:
    """Worst row's max / mean over CP ranks; loads [B, N]."""
    return max(imbalance(row) for row in loads)


def doc_density_cost(
    kept: np.ndarray, allowed: np.ndarray, first_doc: np.ndarray, heads: int
) -> np.ndarray:
    """[B, NB] rho_d * n (at least 1): each document's measured density over layers and
    heads times the blocks a query block may see (K(n) - K(n-1) at constant rho_d)."""
    total = kept.sum(1)
    out = np.ones_like(total)
    for b in range(total.shape[0]):
        _, doc = np.unique(first_doc[b], return_inverse=True)
        pairs = np.bincount(doc, total[b]) / (np.bincount(doc, allowed[b]) * heads * kept.shape[1])
        out[b] = np.maximum(pairs[doc] * allowed[b], 1.0)
    return out


def score(
    source: str,
    beta: float,
    n: int,
    name: str,
    pred: np.ndarray,
    kept: np.ndarray,
    allowed: np.ndarray,
    first_doc: np.ndarray,
) -> list[dict]:
    """Rows of the table for one (source, budget, degree, predictor); kept [B, layers, NB].

    Per layer, and over all layers (sum_l max_r / sum_l mean_r: the ranks meet at every
    layer's all-gather, so that is the attention time's imbalance). `oracle`: the
    balanced split built from the computed tables themselves (summed over layers), the
    best any one-split-per-row predictor could do. `doc_density`: the balanced split on
    rho_d * n per query block with rho_d its document's own measured density (over
    layers): the n-shape of `predicted_block_pairs` with per-document knowledge, what
    per-document history (an earlier epoch's tables) would give if densities recur."""
    B, L = kept.shape[0], kept.shape[2] * BLOCK
    zig = zigzag_split(B, L, n, BLOCK)
    split = document_split(pred, first_doc, n, BLOCK)  # what the trainer runs
    lpt = lpt_split(pred, n, BLOCK)
    oracle = lpt_split(kept.sum(1), n, BLOCK)
    heads = kept_heads(source)
    doc_split = lpt_split(doc_density_cost(kept, allowed, first_doc, heads), n, BLOCK)
    out = []
    for layer in (*range(kept.shape[1]), "all"):
        comp = kept if layer == "all" else kept[:, layer : layer + 1]

        def computed(split, comp=comp):  # [B, layers, N] -> worst row
            loads = np.stack([rank_loads(c, split) for c in comp.transpose(1, 0, 2)], 1)
            return max(float(row.max(-1).sum() / row.mean(-1).sum()) for row in loads)

        out.append(
            {
                "source": source,
                "budget": beta,
                "degree": n,
                "predictor": name,
                "layer": layer,
                "density": float(comp.sum() / (allowed.sum() * heads * comp.shape[1])),
                "predicted_zigzag": worst(rank_loads(pred, zig)),
                "predicted_split": worst(rank_loads(pred, split)),
                "predicted_lpt": worst(rank_loads(pred, lpt)),
                "computed_zigzag": computed(zig),
                "computed_split": computed(split),
                "computed_lpt": computed(lpt),
                "computed_doc_density": computed(doc_split),
                "computed_oracle": computed(oracle),
            }
        )
    return out


def run(setup: Setup, sources: tuple[str, ...], progress=print) -> dict:
    rows = pack_rows(setup.row_len, setup.rows, setup.seed)
    doc_id = doc_ids_from_lengths(rows, setup.row_len)
    allowed = allowed_blocks(doc_id, BLOCK).astype(np.float64)  # [B, NB]
    first_doc = doc_id[:, ::BLOCK].numpy()  # [B, NB] the document each block starts in
    B = len(rows)
    results = []
    fits = {}
    for source in (*sources, "dense"):
        t0 = time.perf_counter()
        if source == "dense":
            kept = allowed[:, None, None, :]  # [B, layers=1, budgets=1, NB]
            budgets, predictors = (1.0,), {"density": lambda beta: allowed}
        else:
            density, profile, fit_density = fit_predictors(source, setup)
            fits[source] = fit_density
            kept = np.stack(
                [kept_tables(source, setup, doc_id[b : b + 1], setup.seed + b)[0] for b in range(B)]
            )
            budgets = setup.budgets
            predictors = {
                "density": lambda beta, d=density: predicted_block_pairs(
                    allowed, lambda lengths: d.predict(beta, lengths), BLOCK
                ),
                "profile": lambda beta, p=profile: p.predict(beta, allowed),
            }
        progress(f"[context_parallel] {source}: tables in {time.perf_counter() - t0:.0f}s")
        for j, beta in enumerate(budgets):
            for n in setup.degrees:
                for name, predict in predictors.items():
                    results += score(
                        source, beta, n, name, predict(beta), kept[:, :, j], allowed, first_doc
                    )
    return {
        "setup": dataclasses.asdict(setup),
        "rows_doc_lens": rows,
        "fit_densities": fits,
        "bar": BAR,
        "results": results,
    }


def kept_heads(source: str) -> int:
    return 1 if source == "dense" else 2  # debug4 and the synthetic q/k: 2 kv heads


def format_table(rep: dict) -> str:
    cols = [
        "predicted_zigzag", "predicted_split", "predicted_lpt", "computed_zigzag",
        "computed_split", "computed_lpt", "computed_doc_density", "computed_oracle",
    ]  # fmt: skip
    head = "| source | budget | CP | predictor | layer | density | " + " | ".join(
        c.replace("_", " ") for c in cols
    )
    lines = [head + " |", "|" + "---|" * (6 + len(cols))]
    for r in rep["results"]:
        cells = [r["source"], f"{r['budget']:g}", r["degree"], r["predictor"], r["layer"]]
        cells += [f"{r['density']:.3f}", *(f"{r[c]:.3f}" for c in cols)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="16K rows, CP 2/4 (a test runs this)")
    p.add_argument("--rows", type=int, help="rows scored (default 4)")
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    setup = dataclasses.replace(QUICK if args.quick else Setup())
    if args.rows:
        setup.rows = args.rows
    t0 = time.perf_counter()
    rep = run(setup, tuple(args.sources))
    rep["seconds"] = time.perf_counter() - t0
    rep["host"] = platform.processor() or platform.machine()
    print(
        f"CP split imbalance (worst of {setup.rows} rows, max/mean over ranks), longtail-v1 "
        f"packed into rows of {setup.row_len}, block {BLOCK}, selection `mass`; "
        f"predictors fitted on {setup.fit_rows} rows of {setup.fit_row_len} (seed {setup.fit_seed})"
    )
    print(format_table(rep))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
