"""The accuracy study's pilot: does a flavor learn the corpus's key -> value recall?

    python bench/recall_pilot.py [--flavor debug4] [--seq-len 128] [--fact-every 32]
                                 [--recalls 4] [--rows 16] [--steps 3000] [--tag NAME]

Dense pretraining in a plain PyTorch loop (AdamW, betas 0.9/0.95, weight decay 0.1,
linear warm-up, then a constant lr), on documents of exactly `--seq-len` tokens from the
bundled corpus's generator with a chosen fact density: a fact every `--fact-every`
tokens, `--recalls` of them recalled at the end. Every `--eval-every` steps it scores
held-out documents (corpus seed 777) the way the study does (sb_titan.eval.heldout):
exact match of every recalled value, plus the argmax accuracy of the value's 1st, 2nd
and 3rd token. The 1st token is where the key must be matched; the later ones can be
continued from the value's own prefix (induction), so the two learn very differently.
A single process on one thread: two pilots run side by side on a 2-core machine. Appends
its curve to bench/results/recall_pilot.json under `--tag`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "recall_pilot.json"
HELDOUT_SEED = 777


def value_token_accuracy(model, docs, rows: int = 16) -> tuple[list[float], float]:
    """Argmax accuracy of the value's first three tokens, and exact match of whole values,
    over every recall of the (equal-length) held-out documents, teacher-forced."""
    from sb_titan.eval.generate import uniform_meta

    hits, seen, exact = np.zeros(3), np.zeros(3), []
    with torch.no_grad():
        for start in range(0, len(docs), rows):
            chunk = docs[start : start + rows]
            ids = torch.as_tensor(np.stack([tokens for tokens, _ in chunk]))
            B, L = ids.shape
            positions = torch.arange(L)[None].expand(B, L)
            predicted = model(
                ids, positions=positions, attention_masks=uniform_meta(B, L, 1.0, ids.device)
            ).argmax(-1)
            for row, (_, recalls) in enumerate(chunk):
                for r in recalls:
                    at = torch.arange(r.value_at, r.value_at + r.value_len)
                    right = (predicted[row, at - 1] == ids[row, at]).tolist()
                    for j, ok in enumerate(right[:3]):
                        hits[j] += ok
                        seen[j] += 1
                    exact.append(all(right))
    return (hits / np.maximum(seen, 1)).tolist(), float(np.mean(exact)) if exact else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavor", default="debug4")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--fact-every", type=int, default=32)
    parser.add_argument("--recalls", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--heldout", type=int, default=128, help="held-out documents")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default=None, help="name of the run in the JSON")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    from sb_titan.data.synthetic import SyntheticCorpus
    from sb_titan.eval.checkpoint import load_from_config
    from sb_titan.eval.generate import uniform_meta
    from sb_titan.eval.heldout import heldout_documents

    L, n_train = args.seq_len, (args.steps + 1) * args.rows
    mix = {"fact_every": args.fact_every, "recalls": args.recalls}
    train = SyntheticCorpus(n_train, L, seed=1, lengths=np.full(n_train, L), **mix)
    docs = heldout_documents([L] * args.heldout, HELDOUT_SEED, **mix)
    config = REPO / "train_configs" / "debug_cpu.toml"
    model = load_from_config(None, config, "dense", ["--model.flavor", args.flavor]).model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    positions = torch.arange(L)[None].expand(args.rows, L)
    meta = uniform_meta(args.rows, L, 1.0, positions.device)
    curve, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = range(step * args.rows, (step + 1) * args.rows)
        ids = torch.as_tensor(np.stack([train.document(i) for i in batch]))
        logits = model(ids, positions=positions, attention_masks=meta)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        warmup.step()
        if step % args.eval_every == 0:
            model.eval()
            acc, em = value_token_accuracy(model, docs)
            model.train()
            curve.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "value_token_acc": [round(a, 4) for a in acc],
                    "em": round(em, 4),
                }
            )
            shown = "/".join(f"{100 * a:.0f}" for a in acc)
            wall = time.perf_counter() - t0
            print(
                f"step {step}: loss {loss.item():.3f}, value tokens 1/2/3 {shown}%, "
                f"exact match {100 * em:.1f}% ({wall:.0f}s)",
                flush=True,
            )
    tag = args.tag or f"{args.flavor}_L{L}_f{args.fact_every}_r{args.recalls}"
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    results[tag] = {
        "args": vars(args) | {"out": None},
        "curve": curve,
        "wall_s": round(time.perf_counter() - t0),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
