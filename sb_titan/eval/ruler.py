"""RULER's NIAH evaluation (Hsieh et al. 2024; NVIDIA/RULER): generate, score, report.

Prompts come from `niah.py`. Generation is greedy with RULER's token budget (prefill
dense or through the recipe's sparse attention, see generate.py); predictions are
post-processed as RULER's evaluate.py and scored with its constants.py metrics:
string_match_all for the niah tasks (per sample the share of references found,
case-insensitively, in the prediction; mean x 100, rounded to 2), string_match_part
(any reference found) for RULER's QA tasks.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sb_titan.eval.generate import greedy_generate
from sb_titan.eval.niah import TASKS, NiahBuilder, NiahSample, read_haystack
from sb_titan.eval.retrieval import plot_grid


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """RULER's niah metric: per sample, the share of references found (case-insensitive
    substring) in the prediction; mean x 100, rounded to 2."""
    score = sum(
        sum(r.lower() in p.lower() for r in ref) / len(ref)
        for p, ref in zip(preds, refs, strict=True)
    )
    return round(score / len(preds) * 100, 2)


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    """RULER's QA metric: per sample, 1 if any reference is found in the prediction."""
    score = sum(
        max(float(r.lower() in p.lower()) for r in ref) for p, ref in zip(preds, refs, strict=True)
    )
    return round(score / len(preds) * 100, 2)


def postprocess_pred(pred: str) -> str:
    """RULER evaluate.py: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


@dataclass
class RulerConfig:
    tasks: tuple[str, ...] = tuple(TASKS)
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    """Target tokens per sample: prompt + generated tokens (RULER's max_seq_length)."""
    samples: int = 20
    seed: int = 42  # RULER's random_seed
    template: str = "corpus"
    haystack: Path | None = None
    """Text file for the essay haystack; None: the synthetic corpus's filler words."""


def sample_seed(seed: int, task: str, length: int, index: int) -> np.random.SeedSequence:
    """Sample `index` of (task, length) is the same whatever else is run."""
    return np.random.SeedSequence([seed, list(TASKS).index(task), length, index])


def predict(model, tokenizer, sample: NiahSample, eos_ids, budget: float) -> str:
    """Greedy answer(s) of one sample, decoded; chained questions see their own answers."""
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    ids, answers = list(sample.ids), []
    stops = [*eos_ids, *sample.stop_ids]
    for step in range(1 + len(sample.followups)):
        if step:
            ids += answers[-1] + sample.followups[step - 1]
        result = greedy_generate(
            model,
            torch.tensor([ids], dtype=torch.long, device=device),
            sample.max_new_tokens,
            stop_ids=stops,
            min_new_tokens=1 if sample.stop_ids else 0,
            budget=budget,
        )
        answers.append(result.tokens[0])
    # joined by spaces so two answers cannot fuse into a third number
    return " ".join(tokenizer.decode(a, skip_special_tokens=True) for a in answers)


def run_ruler(
    model,
    tokenizer,
    cfg: RulerConfig,
    *,
    eos_ids: list[int],
    bos_id: int | None = None,
    budget: float = 1.0,
    out_dir: Path | None = None,
    progress=print,
) -> dict:
    """Score every task at every length (string_match_all, 0-100)."""
    words = read_haystack(cfg.haystack) if cfg.haystack is not None else None
    builder = NiahBuilder(tokenizer, cfg.template, bos_id, words)
    for task in cfg.tasks:  # fail on a too short length before any generation
        builder.build(task, min(cfg.lengths), sample_seed(cfg.seed, task, min(cfg.lengths), 0))
    cells: dict[str, dict[str, dict]] = {}
    t0 = time.perf_counter()
    for task in cfg.tasks:
        for length in cfg.lengths:
            rows = []
            for i in range(cfg.samples):
                sample = builder.build(task, length, sample_seed(cfg.seed, task, length, i))
                pred = postprocess_pred(predict(model, tokenizer, sample, eos_ids, budget))
                rows.append(
                    {
                        "index": i,
                        "pred": pred,
                        "outputs": sample.references,
                        "length": len(sample.ids),
                        "depths": sample.depths,
                    }
                )
            preds, refs = [r["pred"] for r in rows], [r["outputs"] for r in rows]
            cells.setdefault(task, {})[str(length)] = {
                "score": string_match_all(preds, refs),
                "n": len(rows),
                "nulls": sum(not p for p in preds),
                "prompt_tokens": round(sum(r["length"] for r in rows) / len(rows), 1),
            }
            if out_dir is not None:
                _write_jsonl(Path(out_dir) / "pred" / f"{task}-{length}.jsonl", rows)
            progress(
                f"  {task} L={length}: {cells[task][str(length)]['score']:.2f} "
                f"({time.perf_counter() - t0:.0f}s)"
            )
    report = {
        "tasks": cells,
        "average": _averages(cells, cfg.lengths),
        "template": cfg.template,
        "haystack": str(cfg.haystack) if cfg.haystack else "synthetic",
        "lengths": cfg.lengths,
        "samples": cfg.samples,
        "seed": cfg.seed,
        "budget": budget,
        "metric": "string_match_all",
    }
    if out_dir is not None:
        (Path(out_dir) / "result.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _averages(cells: dict, lengths: list[int]) -> dict[str, float]:
    """Mean over tasks per length, and over all cells (RULER's per-length average)."""
    out = {}
    for length in lengths:
        scores = [c[str(length)]["score"] for c in cells.values()]
        out[str(length)] = round(sum(scores) / len(scores), 2)
    out["all"] = round(sum(out.values()) / len(lengths), 2)
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def format_table(report: dict) -> str:
    lengths = [str(x) for x in report["lengths"]]
    lines = [f"{'task':<18}" + "".join(f"{x:>9}" for x in lengths)]
    rows = [*report["tasks"].items(), ("average", report["average"])]
    for name, row in rows:
        cells = (row[x]["score"] if isinstance(row[x], dict) else row[x] for x in lengths)
        lines.append(f"{name:<18}" + "".join(f"{v:>9.2f}" for v in cells))
    lines.append(
        f"string_match_all x100, {report['samples']} samples per cell, "
        f"{report['template']} template, haystack {report['haystack']}"
    )
    return "\n".join(lines)


def save_heatmap(report: dict, path: Path, title: str = "RULER NIAH") -> Path:
    """Score per task x length (0-100), as the retrieval probe's heat map."""
    rows = {
        task: {x: cell["score"] for x, cell in row.items()} for task, row in report["tasks"].items()
    }
    return plot_grid(rows, path, xlabel="context length (tokens)", title=title, vmax=100)
