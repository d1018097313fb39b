"""Which blocks to keep: every estimator family and policy at equal realised density.

    python bench/selection.py            # full: 64 held-out documents, hours on 2 cores
    python bench/selection.py --quick    # 2 documents at 1024 tokens, density 0.3 (tests)
    python bench/selection.py cost       # each scorer's cost beside the attention's
    python bench/selection.py plot       # docs/selection.png and the markdown table

For each scorer (attention/block_scores.py) and policy, at realised density 0.8, 0.5,
0.3 and 0.2 (each method's budget calibrated to it), on three inputs:
  - `base`: the shipped accuracy base (bench/accuracy_base) on the study's held-out
    documents (2048 and 4096 tokens), the whole model running that selection in its
    sparse layers (1-3): true recall and top-key hit rate of sampled queries
    (attention/recall.py), estimated recall, and held-out exact match;
  - `random`: the same model shape, randomly initialised (no exact match);
  - `synthetic`: bench/context_parallel.py's selective pattern, one attention layer.
`topk` keeps ceil(beta * n) blocks per query block whatever the scorer, so its budget
is the density (no calibration); `mass` is calibrated by bisection on a few documents.
Rows are appended to the JSONL file as they are measured; a rerun skips rows already
there (resume). Beside them, each scorer's cost relative to the attention it selects
for: CPU time per layer at 4096 tokens, and FLOPs / bytes at 32K for a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from context_parallel import pack_rows, synthetic_qk  # noqa: E402

from sb_titan.attention.block_scores import SCORERS  # noqa: E402
from sb_titan.attention.layout import AttnMeta, doc_ids_from_lengths  # noqa: E402
from sb_titan.attention.ops import attention_forward, measure_true_recall, select  # noqa: E402
from sb_titan.attention.selection import STATS_SIZE  # noqa: E402
from sb_titan.attention.sparse import sparse_attention  # noqa: E402
from sb_titan.eval.checkpoint import build_model, load_from_hf  # noqa: E402
from sb_titan.eval.heldout import heldout_documents  # noqa: E402

BASE = REPO / "bench" / "accuracy_base"
OUT = REPO / "bench" / "results" / "selection.jsonl"
HELDOUT_SEED, LENGTHS = 777, (2048, 4096)  # the accuracy study's held-out set
DENSITIES = (0.5, 0.3, 0.2, 0.8)  # the decisive ones first: a cut-off run keeps them
ORDER = ("int4_max", "mean", "exact_max", "exact", "kmax", "pool8_max")
METHODS = [(s, "topk") for s in ORDER] + [("mean", "mass"), ("int4_max", "mass")]


def _configure(model, scorer: str, policy: str, rate: float = 1.0) -> None:
    for layer in model.layers.values():
        inner = layer.attention.inner_attention
        inner.config.scorer, inner.config.policy = scorer, policy
        inner.config.true_recall_rate = rate


@torch.no_grad()
def run_documents(model, docs, budget: float) -> dict:
    """Exact match and the summed statistics of the model over `docs` at `budget`."""
    exact, sums = [], torch.zeros(STATS_SIZE, dtype=torch.float64)
    for n, (tokens, recalls) in enumerate(docs, 1):
        if n % 16 == 0:
            print(f"  ... {n}/{len(docs)} documents at budget {budget:.3f}", flush=True)
        ids = torch.as_tensor(tokens, dtype=torch.long)[None]
        L = ids.shape[1]
        stats = torch.zeros(STATS_SIZE)
        meta = AttnMeta(torch.zeros(1, L, dtype=torch.int32), torch.full((1,), budget), None, stats)
        logits = model(ids, positions=torch.arange(L)[None], attention_masks=meta)[0]
        predicted = logits.argmax(-1)
        for r in recalls:
            span = slice(r.value_at - 1, r.value_at - 1 + r.value_len)
            exact.append(
                bool((predicted[span] == ids[0, r.value_at : r.value_at + r.value_len]).all())
            )
        sums += stats.double()
    return {
        "exact_match": sum(exact) / len(exact) if exact else None,
        "recalls": len(exact),
        **_ratios(sums),
    }


def _ratios(s: torch.Tensor) -> dict:
    """Means from STATS_FIELDS sums: density, estimated and true recall, top-key hits."""
    return {
        "density": float(s[0] / s[1]) if s[1] else 1.0,
        "estimated_recall": float(s[2] / s[3]) if s[3] else 1.0,
        "true_recall": float(s[4] / s[6]) if s[6] else None,
        "top_key_hit": float(s[5] / s[6]) if s[6] else None,
    }


def calibrate(density_at: Callable[[float], float], target: float, iters: int) -> float:
    """The `mass` budget whose realised density (`density_at(beta)`) is closest to
    `target`, by bisection (density grows with beta)."""
    lo, hi, best = 0.02, 1.0, (math.inf, 1.0)
    for _ in range(iters):
        beta = (lo + hi) / 2
        rho = density_at(beta)
        best = min(best, (abs(rho - target), beta))
        lo, hi = (beta, hi) if rho < target else (lo, beta)
    return best[1]


def _done(path: Path) -> set[tuple]:
    if not path.exists():
        return set()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["input"], r["scorer"], r["policy"], r["target_density"]) for r in rows}


def _append(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
    print(json.dumps(shown), flush=True)


def model_rows(args, name: str, model, docs, calib_docs, done: set) -> None:
    for target in args.densities:
        for scorer, policy in args.methods:
            key = (name, scorer, policy, target)
            if key in done:
                continue
            _configure(model, scorer, policy)
            t0 = time.perf_counter()
            budget = (
                target
                if policy == "topk"
                else calibrate(
                    lambda b: run_documents(model, calib_docs, b)["density"], target, args.iters
                )
            )
            got = run_documents(model, docs, budget)
            if name != "base":
                got["exact_match"] = None
            row = {"input": name, "scorer": scorer, "policy": policy, "target_density": target}
            _append(args.out, {**row, "budget": budget, **got, "wall_s": time.perf_counter() - t0})
    key = (name, "dense", "-", 1.0)
    if key not in done:
        _configure(model, "mean", "topk", rate=0.0)
        got = run_documents(model, docs, 1.0)
        _append(args.out, {"input": name, "scorer": "dense", "policy": "-", "target_density": 1.0,
                           "budget": 1.0, **got})  # fmt: skip


def synthetic_rows(args, done: set) -> None:
    """bench/context_parallel.py's selective pattern (4 layers, one packed row): block-
    constant q/k with a few hot key blocks, where the block means are the whole story."""
    L = 2048 if args.quick else 16384
    doc_id = doc_ids_from_lengths(pack_rows(L, 1, 0), L)
    layers = [(q, k) for _, q, k in synthetic_qk(doc_id, seed=0)]
    for scorer, policy in args.methods:
        for target in args.densities:
            if ("synthetic", scorer, policy, target) in done:
                continue
            budget = target
            if policy == "mass":  # calibrated on the layers' mean density

                def density_at(beta: float, scorer=scorer) -> float:
                    return sum(
                        float(select(q, k, doc_id, beta, policy="mass", block_size=64,
                                     scale=q.shape[-1] ** -0.5, scorer=scorer)[1].density.mean())
                        for q, k in layers
                    ) / len(layers)  # fmt: skip

                budget = calibrate(density_at, target, args.iters)
            sums = torch.zeros(STATS_SIZE, dtype=torch.float64)
            for q, k in layers:
                _, st = sparse_attention(q, k, torch.randn_like(k), doc_id, budget, policy=policy,
                                         scorer=scorer, true_recall_rate=1.0)  # fmt: skip
                sums += st.totals().double()
            row = {
                "input": "synthetic",
                "scorer": scorer,
                "policy": policy,
                "target_density": target,
            }
            _append(args.out, {**row, "budget": budget, **_ratios(sums), "exact_match": None})


def costs(args) -> list[dict]:
    """Each scorer's selection time per layer against the attention forward it selects
    for (CPU, one thread, 4096 tokens, the base's heads; median of 3; process CPU time,
    so that other processes on a shared machine do not enter the ratio), and its FLOPs and
    bytes per kv head at 32K for a GPU, beside attention's at density 0.3."""
    L = 1024 if args.quick else 4096
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, L, 64, generator=g) for h in (4, 2, 2))  # the base's heads
    doc_id = torch.zeros(1, L, dtype=torch.int64)
    scale = 64**-0.5
    out = []
    for scorer in SCORERS:
        times = []
        for _ in range(3):
            t0 = time.process_time()
            table, _ = select(q, k, doc_id, 0.3, policy="topk", block_size=64, scale=scale,
                              scorer=scorer)  # fmt: skip
            times.append(time.process_time() - t0)
        t0 = time.process_time()
        attention_forward(q, k, v, doc_id, table, scale, "torch")
        attn = time.process_time() - t0
        out.append({"scorer": scorer, "select_s": sorted(times)[1], "attention_fwd_s": attn,
                    "select_over_attention_fwd": sorted(times)[1] / attn,
                    **gpu_cost(scorer, 32768, 64, 128, 7)})  # fmt: skip
    return out


def sampling_cost(args, repeats: int = 5) -> dict:
    """True recall's share of a training step: forward + backward of the accuracy base
    (3 sparse layers, `mean`, budget 0.5) on one 4096-token document, with the sampled
    measurement at rate 1 and off, interleaved, medians of `repeats` (process CPU time,
    one thread: a shared machine's other load does not enter it)."""
    loaded = load_from_hf(BASE, attention="sparse")
    model = loaded.model
    L = 1024 if args.quick else 4096
    ids = torch.randint(
        0, loaded.dims.vocab_size, (1, L), generator=torch.Generator().manual_seed(0)
    )
    times: dict[float, list[float]] = {1.0: [], 0.0: []}
    for _ in range(repeats):
        for rate in times:
            _configure(model, "mean", "topk", rate)
            meta = AttnMeta(torch.zeros(1, L, dtype=torch.int32), torch.full((1,), 0.5), None,
                            torch.zeros(STATS_SIZE))  # fmt: skip
            model.zero_grad(set_to_none=True)
            t0 = time.process_time()
            model(ids, positions=torch.arange(L)[None], attention_masks=meta).float().logsumexp(
                -1
            ).mean().backward()
            times[rate].append(time.process_time() - t0)
    on, off = (sorted(t)[len(t) // 2] for t in times.values())
    spread = {r: (min(t), max(t)) for r, t in times.items()}
    # the measurement alone, on one sparse layer's shape, times the sparse layers: far
    # less noisy than the difference of two whole steps on a shared machine
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, L, 64, generator=g) for h in (4, 2, 2))
    doc_id = torch.zeros(1, L, dtype=torch.int64)
    table, _ = select(q, k, doc_id, 0.5, policy="topk", block_size=64, scale=0.125)
    _, lse = attention_forward(q, k, v, doc_id, table, 0.125, "torch")
    op = []
    for _ in range(repeats):
        t0 = time.process_time()
        measure_true_recall(q, k, doc_id, lse, table, scale=0.125, rate=1.0, lse_base2=False)
        op.append(time.process_time() - t0)
    layers = sum(layer.attention.inner_attention.config.sparse for layer in model.layers.values())
    op_share = layers * min(op) / min(times[0.0])
    return {"step_s_with": on, "step_s_without": off, "share": on / off - 1,
            "min_max_with": spread[1.0], "min_max_without": spread[0.0], "tokens": L,
            "op_s_per_layer_min": min(op), "sparse_layers": layers,
            "op_share_of_step": op_share}  # fmt: skip


def gpu_cost(scorer: str, L: int, bs: int, d: int, group: int) -> dict:
    """Multiply-adds and bytes read per kv head for one row of L tokens (causal halves),
    against sparse attention forward + backward at density 0.3 (3.5x the forward's
    2 matmuls, recomputation included, bf16)."""
    nb = L // bs
    pairs = nb * (nb + 1) / 2
    attn_macs = 3.5 * 2 * pairs * bs * bs * d * group * 0.3
    macs, nbytes, precision = {
        "mean": (pairs * d, 2 * L * d * (group + 1), "fp32"),
        "int4_max": (pairs * bs * bs * d * group, L * d * (group + 1) // 2, "int4/int8"),
        "kmax": (nb * L / 2 * d, 2 * L * d * (group + 1), "bf16"),
        "pool8_max": (pairs * 64 * d * group, 2 * L * d * (group + 1), "bf16"),
        "exact": (pairs * bs * bs * d * group, 2 * L * d * (group + 1), "fp32"),
        "exact_max": (pairs * bs * bs * d * group, 2 * L * d * (group + 1), "fp32"),
    }[scorer]
    return {
        "gpu_macs_over_attention": macs / attn_macs,
        "gpu_bytes": nbytes,
        "precision": precision,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", nargs="?", default="run", choices=["run", "cost", "plot"])
    ap.add_argument("--quick", action="store_true", help="2 documents, density 0.3, 1024 tokens")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--iters", type=int, default=6, help="bisection steps of a `mass` budget")
    ap.add_argument(
        "--inputs", default=None, help="default base,random,synthetic (quick: no random)"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--methods", default=None, help="scorer:policy,... (default: all)")
    ap.add_argument("--densities", default=None, help="comma-separated (default: all four)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = OUT if not args.quick else Path("/tmp/sb_selection_quick.jsonl")
    if args.command == "plot":
        return plot(args.out)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.command == "cost":
        cost = {"scorers": costs(args), "true_recall_sampling": sampling_cost(args)}
        cost_path = args.out.with_name(args.out.stem + "_cost.json")
        cost_path.write_text(json.dumps(cost, indent=1) + "\n")
        for c in [*cost["scorers"], cost["true_recall_sampling"]]:
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in c.items()}))
        return 0
    args.methods = (
        [tuple(m.split(":")) for m in args.methods.split(",")] if args.methods else METHODS
    )
    if args.densities:
        args.densities = tuple(float(d) for d in args.densities.split(","))
    else:
        args.densities = (0.3,) if args.quick else DENSITIES
    if args.quick:
        args.iters = min(args.iters, 3)
    done = _done(args.out)
    inputs = (args.inputs or ("base,synthetic" if args.quick else "base,random,synthetic")).split(
        ","
    )
    n = 2 if args.quick else args.docs
    lengths = (1024,) if args.quick else LENGTHS
    docs = heldout_documents([lengths[i % len(lengths)] for i in range(n)], HELDOUT_SEED)
    calib = docs[: 2 if args.quick else 4]
    if "base" in inputs:
        loaded = load_from_hf(BASE, attention="sparse")
        model_rows(args, "base", loaded.model.eval(), docs, calib, done)
    if "random" in inputs:
        loaded = load_from_hf(BASE, attention="sparse")
        model = build_model(loaded.dims, loaded.attention).eval()
        model_rows(args, "random", model, docs[: max(2, n // 8)], calib[:2], done)
    if "synthetic" in inputs:
        synthetic_rows(args, done)
    return 0


def plot(path: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    base = [r for r in rows if r["input"] == "base"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for scorer, policy in METHODS:
        rs = sorted((r for r in base if (r["scorer"], r["policy"]) == (scorer, policy)),
                    key=lambda r: r["density"])  # fmt: skip
        if not rs:
            continue
        x = [r["density"] for r in rs]
        style = "--" if scorer.startswith("exact") else "-"
        label = f"{scorer} ({policy})"
        axes[0].plot(x, [r["true_recall"] for r in rs], style, marker="o", label=label)
        axes[1].plot(x, [100 * r["exact_match"] for r in rs], style, marker="o", label=label)
    dense = [r for r in base if r["scorer"] == "dense"]
    if dense:
        axes[1].axhline(100 * dense[0]["exact_match"], color="k", lw=0.8, label="dense")
    axes[0].set(xlabel="realised density", ylabel="true recall (sampled queries)")
    axes[1].set(xlabel="realised density", ylabel="held-out exact match (%)")
    axes[1].legend(fontsize=7)
    fig.suptitle("Selection on the accuracy base: true recall and exact match by density")
    fig.tight_layout()
    out = REPO / "docs" / "selection.png"
    fig.savefig(out, dpi=110)
    print(table(base))
    print(f"wrote {out}")
    return 0


def table(rows: list[dict]) -> str:
    """Markdown: one row per method and density, exact match beside the three recalls."""
    dense = next((r for r in rows if r["scorer"] == "dense"), None)
    head = "dense exact match: " + (f"{100 * dense['exact_match']:.1f}%" if dense else "—")
    lines = [
        head,
        "",
        "| scorer | policy | target | density | exact match % | true recall | top-key hit "
        "| est. recall | budget |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    key = {m: i for i, m in enumerate(METHODS)}
    for r in sorted(
        (r for r in rows if r["scorer"] != "dense"),
        key=lambda r: (-r["target_density"], key.get((r["scorer"], r["policy"]), 99)),
    ):
        lines.append(
            f"| {r['scorer']} | {r['policy']} | {r['target_density']} | {r['density']:.3f} | "
            f"{100 * r['exact_match']:.1f} | {r['true_recall']:.3f} | {r['top_key_hit']:.3f} | "
            f"{r['estimated_recall']:.3f} | {r['budget']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
