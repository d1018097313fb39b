"""bench/doc_history.py --quick: the trainer's balancer over a fixed set of documents
for three epochs, each trained document reporting its kept mass to the planner. The
documents' true recall is computed from the committed held-out curves and the assumed
sensitivities, outside the allocator; what is checked is that reports come back with
the documents and change the split, never the micro-batch budgets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # as the bench runs: its folder first on the path
try:
    import doc_history as bench
finally:
    sys.path.remove(str(REPO / "bench"))


def test_quick_history_changes_the_split_and_only_the_split(tmp_path):
    out = tmp_path / "doc_history.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    (rep,) = json.loads(out.read_text())["runs"]
    first, *later = rep["epochs"]
    # the first epoch's steps see no or few earlier reports; later ones carry most
    assert all(e["history"]["with_history"] > e["history"]["documents"] // 2 for e in later)
    assert rep["same_microbatch_budgets"]  # DST's budgets never read a document's history
    length = [r["true_recall"] for r in rep["steps"]["length"]]
    for variant in ("history", "oracle"):
        steps = rep["steps"][variant]
        assert steps[0]["true_recall"] == length[0]  # nothing reported before step 0
        gain = sum(r["true_recall"] for r in steps) - sum(length)
        assert gain > 0, (variant, gain)  # in the same attention time
