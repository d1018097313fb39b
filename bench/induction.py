"""The accuracy pilot's control: does a flavor learn to copy at a given learning rate?

    python bench/induction.py [--flavor debug] [--lrs 1e-3,3e-3,1e-2] [--steps 400]

The classic induction task (16 rows of 64 random tokens, each repeated once) trained in
a plain PyTorch loop on the recipe's model with AdamW (betas 0.9/0.95, weight decay 0.1,
no schedule). Copy accuracy is the argmax accuracy on the repeated half; it jumps from
~0 to ~1 when the induction circuit forms. Prints the step at which accuracy first
exceeds 0.5 per learning rate and writes bench/results/induction.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "induction.json"


def run(flavor: str, lr: float, steps: int, rows: int = 16, half: int = 64) -> dict:
    from sb_titan.eval.checkpoint import load_from_config
    from sb_titan.eval.generate import uniform_meta

    torch.manual_seed(0)
    config = REPO / "train_configs" / "debug_cpu.toml"
    model = load_from_config(None, config, "dense", ["--model.flavor", flavor]).model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    length = 2 * half
    positions = torch.arange(length)[None].expand(rows, length)
    curve, learned_at, t0 = [], None, time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randint(10, 1000, (rows, half))
        ids = torch.cat([x, x], 1)
        meta = uniform_meta(rows, length, 1.0, ids.device)
        logits = model(ids, positions=positions, attention_masks=meta)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0:
            acc = float((logits[:, half:-1].argmax(-1) == ids[:, half + 1 :]).float().mean())
            curve.append((step, round(acc, 3)))
            if learned_at is None and acc > 0.5:
                learned_at = step
            print(f"  lr {lr:g} step {step}: copy accuracy {acc:.2f}", flush=True)
    wall = round(time.perf_counter() - t0)
    return {"lr": lr, "learned_at": learned_at, "curve": curve, "s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = [run(args.flavor, float(lr), args.steps) for lr in args.lrs.split(",")]
    print("| lr | copy accuracy > 0.5 at step |\n|---|---|")
    for r in runs:
        print(f"| {r['lr']:g} | {r['learned_at'] or f'not within {args.steps}'} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"flavor": args.flavor, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
