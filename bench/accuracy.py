"""Accuracy side of the trade: what sparse training (and SAB+DST) costs in model quality.

    python bench/accuracy.py [--quick] [--steps N] [--seeds 0,1]

Trains the debug model (train_configs/debug_cpu.toml, 2 CPU processes, torchrun) for a
fixed number of steps as three variants — dense attention, static sparse at beta0, and
SAB+DST (analytic CPU cost model unless profiles/debug_cpu.json exists) — once per
seed. Each run saves a model-only DCP checkpoint; this process then loads it and
measures, on synthetic documents the run never saw (another corpus seed):

- held-out loss, with the variant's own attention (sparse variants at beta0) and dense;
- key-value retrieval accuracy (sb-eval retrieval's probe) by length and depth;

next to the run's median step time (TensorBoard time_metrics/end_to_end, after warm-up).
Writes bench/results/accuracy.json and the table in docs/eval.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sb_titan.runtime.tensorboard import read_scalars

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "debug_cpu.toml"
PROFILE = REPO / "profiles" / "debug_cpu.json"
OUT = REPO / "bench" / "results" / "accuracy.json"
DOC = REPO / "docs" / "eval.md"
WARMUP = 2
HELDOUT_SEED = 777  # training reads corpus seed 0
HELDOUT_DOCS = 32
MIN_DOC_LEN = 256


def variants() -> dict[str, tuple[list[str], str]]:
    """name -> (training overrides, attention used for evaluation)."""
    cost = (
        ["--cost_model.profile", str(PROFILE)]
        if PROFILE.is_file()
        else ["--cost_model.analytic_device", "cpu"]
    )
    return {
        "dense": (["--sparse_attention.no-enabled"], "dense"),
        "static_sparse": (["--sab.policy", "sequential"], "sparse"),
        "sab_dst": (["--sab.policy", "sab", "--dst.enabled", *cost], "sparse"),
    }


def train(name: str, args: list[str], seed: int, steps: int, root: Path) -> Path:
    dump = root / f"{name}_seed{seed}"
    subprocess.run(["rm", "-rf", str(dump)], check=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "sb_titan.tools.train",
        "--config_file",
        str(CONFIG),
        "--dump_folder",
        str(dump),
        "--training.steps",
        str(steps),
        "--debug.seed",
        str(seed),
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(steps),
        "--checkpoint.last_save_model_only",
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(
            f"{name} seed {seed}: training failed\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    print(f"  trained {name} seed {seed} in {time.perf_counter() - t0:.0f}s", flush=True)
    return dump


def _median_after_warmup(series: dict[int, float]) -> float:
    values = [v for step, v in sorted(series.items()) if step > WARMUP]
    return float(statistics.median(values)) if values else float("nan")


def _mean_last(series: dict[int, float], n: int = 5) -> float:
    values = [v for _, v in sorted(series.items())][-n:]
    return float(statistics.fmean(values)) if values else float("nan")


def heldout_docs(row_len: int) -> list[torch.Tensor]:
    """Unseen synthetic documents (another corpus seed), each at most one row long."""
    from sb_titan.data.synthetic import SyntheticCorpus

    corpus = SyntheticCorpus(20000, row_len, seed=HELDOUT_SEED)
    docs = []
    for i in range(len(corpus.lengths)):
        if corpus.lengths[i] >= MIN_DOC_LEN:
            docs.append(torch.from_numpy(corpus.document(i)[:row_len]))
        if len(docs) == HELDOUT_DOCS:
            break
    return docs


@torch.no_grad()
def heldout_loss(model, docs: list[torch.Tensor], budget: float) -> dict[str, float]:
    """Token-mean next-token loss, overall and on the recalled values (' recall key K : V')."""
    from sb_titan.eval.generate import _meta

    total = count = 0.0
    for doc in docs:
        tokens = doc[None]
        L = tokens.shape[1]
        logits = model(
            tokens,
            positions=torch.arange(L)[None],
            attention_masks=_meta(1, L, budget, tokens.device),
        )
        loss = F.cross_entropy(logits[0, :-1].float(), tokens[0, 1:], reduction="sum")
        total += float(loss)
        count += L - 1
    return {"loss": total / count, "tokens": int(count)}


def evaluate(dump: Path, attention: str, docs, retrieval_cfg) -> dict:
    from sb_titan.data.tokenizer import load_tokenizer
    from sb_titan.eval.checkpoint import load_from_config
    from sb_titan.eval.retrieval import run_retrieval

    out: dict = {}
    for mode in dict.fromkeys([attention, "dense"]):
        loaded = load_from_config(dump / "checkpoint", CONFIG, mode)
        budget = loaded.default_budget if mode == "sparse" else 1.0
        out[f"heldout_loss_{mode}"] = round(heldout_loss(loaded.model, docs, budget)["loss"], 4)
        if mode == attention:
            tok = load_tokenizer(loaded.tokenizer_dir)
            rep = run_retrieval(loaded.model, tok, retrieval_cfg, budget, progress=lambda *_: None)
            out["retrieval"] = rep["accuracy"]
            out["retrieval_mean"] = round(rep["mean"], 4)
            out["eval_budget"] = budget
    return out


def summarize(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs]
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": round(mean, 4), "std": round(std, 4), "values": values}


def markdown(result: dict) -> str:
    seeds = ",".join(str(s) for s in result["seeds"])
    head = (
        f"Debug model, {result['steps']} steps, seq_len {result['seq_len']}, 2 CPU ranks; "
        f"seeds {seeds} (mean ± std over seeds); held-out = {result['heldout']['docs']} unseen "
        f"synthetic documents (corpus seed {result['heldout']['corpus_seed']}); retrieval = "
        f"lengths {result['retrieval']['lengths']} × depths {result['retrieval']['depths']}, "
        f"{result['retrieval']['trials']} trials per cell.\n\n"
    )
    rows = [
        "| variant | eval attention | train density | held-out loss | Δ vs dense (paired) | "
        "held-out loss (dense eval) | retrieval acc. | step time (s) | final train loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(s: dict, digits: int = 3) -> str:
        return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"

    def own_loss(run: dict) -> float:
        return run.get("heldout_loss_sparse", run["heldout_loss_dense"])

    dense_by_seed = {r["seed"]: own_loss(r) for r in result["variants"]["dense"]["runs"]}
    for name, v in result["variants"].items():
        s = v["summary"]
        mode = v["eval_attention"]
        if mode == "sparse":
            mode += f" (β={v['eval_budget']:g})"
        own = s.get("heldout_loss_sparse") or s["heldout_loss_dense"]
        deltas = [own_loss(r) - dense_by_seed[r["seed"]] for r in v["runs"]]
        delta = ", ".join(f"{d:+.4f}" for d in deltas)
        density = [r["train_density"] for r in v["runs"] if "train_density" in r]
        dens = f"{statistics.fmean(density):.3f}" if density else "1 (dense)"
        rows.append(
            f"| {name} | {mode} | {dens} | {cell(own)} | {delta} | "
            f"{cell(s['heldout_loss_dense'])} | {cell(s['retrieval_mean'], 2)} | "
            f"{cell(s['step_time_s'], 2)} | {cell(s['final_train_loss'])} |"
        )
    return head + "\n".join(rows) + "\n"


def write_doc_table(table: str) -> None:
    """Replace the generated block in docs/eval.md (between the accuracy markers)."""
    begin, end = "<!-- accuracy:begin -->", "<!-- accuracy:end -->"
    text = DOC.read_text() if DOC.is_file() else f"# Evaluation\n\n{begin}\n{end}\n"
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    DOC.write_text(pattern.sub(lambda _: f"{begin}\n{table}{end}", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 10 steps, small probe")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", default=None, help="comma-separated debug.seed values")
    parser.add_argument("--root", default="/tmp/sb_accuracy", help="dump folders")
    parser.add_argument(
        "--table-only", action="store_true", help="rewrite docs/eval.md's table from the JSON"
    )
    args = parser.parse_args()
    if args.table_only:
        write_doc_table(markdown(json.loads(OUT.read_text())))
        return

    from sb_titan.eval.retrieval import RetrievalConfig

    steps = args.steps or (10 if args.quick else 30)
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1")).split(",")]
    retrieval_cfg = RetrievalConfig(
        lengths=[512, 1024], depths=[0.0, 0.5, 1.0], trials=4 if args.quick else 6, seed=4321
    )
    torch.set_num_threads(2)
    root = Path(args.root)
    seq_len = 1024  # debug_cpu.toml
    docs = heldout_docs(seq_len)
    t_start = time.perf_counter()
    result: dict = {
        "config": str(CONFIG.relative_to(REPO)),
        "steps": steps,
        "seq_len": seq_len,
        "seeds": seeds,
        "heldout": {"corpus_seed": HELDOUT_SEED, "docs": len(docs), "min_len": MIN_DOC_LEN},
        "retrieval": {
            "lengths": retrieval_cfg.lengths,
            "depths": retrieval_cfg.depths,
            "trials": retrieval_cfg.trials,
            "seed": retrieval_cfg.seed,
        },
        "cost_model": str(PROFILE.relative_to(REPO)) if PROFILE.is_file() else "analytic cpu",
        "variants": {},
    }
    for name, (overrides, attention) in variants().items():
        runs = []
        for seed in seeds:
            dump = train(name, overrides, seed, steps, root)
            tb = read_scalars(dump)
            run = {
                "seed": seed,
                "step_time_s": round(_median_after_warmup(tb["time_metrics/end_to_end(s)"]), 4),
                "final_train_loss": round(_mean_last(tb["loss_metrics/global_avg_loss"]), 4),
            }
            if "sparsity/density" in tb:
                run["train_density"] = round(_mean_last(tb["sparsity/density"], steps), 4)
            if "dst/budget_mean" in tb:
                run["train_budget_mean"] = round(_mean_last(tb["dst/budget_mean"], steps), 4)
            run.update(evaluate(dump, attention, docs, retrieval_cfg))
            runs.append(run)
            print(
                f"  {name} seed {seed}: "
                + json.dumps({k: v for k, v in run.items() if k != "retrieval"}),
                flush=True,
            )
        keys = ["step_time_s", "final_train_loss", "heldout_loss_dense", "retrieval_mean"]
        if attention == "sparse":
            keys.append("heldout_loss_sparse")
        result["variants"][name] = {
            "train_overrides": overrides,
            "eval_attention": attention,
            "eval_budget": runs[0]["eval_budget"],
            "runs": runs,
            "summary": {k: summarize(runs, k) for k in keys},
        }
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    write_doc_table(table)
    print(table)
    print(f"wrote {OUT} and the table in {DOC} ({result['wall_s']:.0f}s)")


if __name__ == "__main__":
    main()
