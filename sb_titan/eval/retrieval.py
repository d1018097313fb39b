"""Key-value retrieval probe by context length and fact depth (CPU-sized models).

Documents use the synthetic training corpus's own vocabulary and phrasing: filler
words, one fact " key K : V ." at relative depth d of the filler, and the query
" recall key K :" at the end. The model must greedily produce the value's tokens
exactly. Depth 0 puts the fact right after BOS, depth 1 right before the query.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sb_titan.data.synthetic import FACT, QUERY, WORDS
from sb_titan.data.tokenizer import BOS
from sb_titan.eval.generate import greedy_generate


@dataclass
class Probe:
    ids: list[int]
    answer: list[int]  # the value's tokens
    fact_at: int  # token index where the fact starts


def parse_lengths(text: str) -> list[int]:
    """'1k,2k,512' -> [1024, 2048, 512]."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


class ProbeBuilder:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.bos = tokenizer.token_to_id(BOS)
        self.word_ids = [self._enc(" " + w) for w in WORDS]

    def _enc(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _filler(self, rng: np.random.Generator, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += self.word_ids[int(rng.integers(len(WORDS)))]
        return out[:n]

    def build(self, length: int, depth: float, rng: np.random.Generator) -> Probe:
        """A probe of exactly `length` tokens (BOS + filler + fact + filler + query)."""
        key, value = (int(x) for x in rng.integers(0, 10000, 2))
        fact = self._enc(FACT.format(key=key, value=value))
        query = self._enc(QUERY.format(key=key))
        n_filler = length - 1 - len(fact) - len(query)
        if n_filler < 0:
            raise ValueError(f"retrieval: length {length} is too short for a fact and a query")
        filler = self._filler(rng, n_filler)
        cut = int(round(depth * n_filler))
        ids = [self.bos, *filler[:cut], *fact, *filler[cut:], *query]
        return Probe(ids, self._enc(f" {value}"), 1 + cut)


@dataclass
class RetrievalConfig:
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    trials: int = 8
    seed: int = 1234
    batch_size: int = 1
    """Probes per forward (all probes of a cell have the same length)."""


def run_retrieval(
    model, tokenizer, cfg: RetrievalConfig, budget: float = 1.0, progress=print
) -> dict:
    """Exact-match accuracy per (length, depth); fresh probes per cell, seeded."""
    builder = ProbeBuilder(tokenizer)
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    grid: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for li, length in enumerate(cfg.lengths):
        row = grid.setdefault(str(length), {})
        for di, depth in enumerate(cfg.depths):
            rng = np.random.default_rng([cfg.seed, li, di])
            probes = [builder.build(length, depth, rng) for _ in range(cfg.trials)]
            hits = 0
            for s in range(0, len(probes), cfg.batch_size):
                chunk = probes[s : s + cfg.batch_size]
                n_new = max(len(p.answer) for p in chunk)
                prompt = torch.tensor([p.ids for p in chunk], dtype=torch.long, device=device)
                result = greedy_generate(model, prompt, n_new, budget=budget)
                hits += sum(
                    got[: len(p.answer)] == p.answer
                    for got, p in zip(result.tokens, chunk, strict=True)
                )
            row[f"{depth:g}"] = hits / len(probes)
            progress(
                f"  retrieval L={length} depth={depth:g}: {hits}/{len(probes)} "
                f"({time.perf_counter() - t0:.0f}s)"
            )
    flat = [v for r in grid.values() for v in r.values()]
    return {
        "accuracy": grid,
        "mean": sum(flat) / len(flat),
        "trials": cfg.trials,
        "seed": cfg.seed,
        "budget": budget,
    }


def format_grid(report: dict) -> str:
    grid = report["accuracy"]
    depths = list(next(iter(grid.values())))
    lines = ["length \\ depth " + "".join(f"{d:>7}" for d in depths)]
    for length, row in grid.items():
        lines.append(f"{length:>15}" + "".join(f"{row[d]:>7.2f}" for d in depths))
    lines.append(f"mean {report['mean']:.3f} ({report['trials']} trials per cell)")
    return "\n".join(lines)


def save_heatmap(report: dict, path: Path, title: str = "key-value retrieval") -> Path:
    grid = {length: dict(row) for length, row in report["accuracy"].items()}
    return plot_grid(grid, path, "fact depth", "context length (tokens)", title)


def plot_grid(
    rows: dict[str, dict[str, float]],
    path: Path,
    xlabel: str = "",
    ylabel: str = "",
    title: str = "",
    vmax: float = 1.0,
) -> Path:
    """A red-to-green heat map of rows x columns with the values written in (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, cols = list(rows), list(next(iter(rows.values())))
    data = np.array([[rows[r][c] for c in cols] for r in names])
    width = max(len(n) for n in names) * 0.07
    fig, ax = plt.subplots(figsize=(1.2 + width + 0.9 * len(cols), 1.0 + 0.6 * len(names)))
    im = ax.imshow(data, vmin=0, vmax=vmax, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fmt = ".2f" if vmax <= 1 else ".0f"
    for i in range(len(names)):
        for j in range(len(cols)):
            ax.text(j, i, format(data[i, j], fmt), ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
