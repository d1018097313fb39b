"""bench/recall_pilot.py: its batched value-token scoring agrees with the study's own
held-out scorer, and a short run (its `main`, in this process) writes its curve."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import torch
from conftest import REPO

from sb_titan.data.synthetic import SyntheticCorpus
from sb_titan.eval.heldout import score_heldout

_spec = importlib.util.spec_from_file_location("recall_pilot", REPO / "bench" / "recall_pilot.py")
pilot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pilot)


class Oracle(torch.nn.Module):
    """Predicts each next token from the input itself; `wrong_docs` rows predict the
    current token instead (a model off by one)."""

    def __init__(self, wrong_docs: set[int]) -> None:
        super().__init__()
        self.wrong_docs = wrong_docs
        self.weight = torch.nn.Parameter(torch.zeros(1))  # score_heldout asks for a device

    def forward(self, ids, positions, attention_masks):
        target = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
        for row in range(ids.shape[0]):
            if int(ids[row].sum()) in self.wrong_docs:
                target[row] = ids[row]
        return torch.nn.functional.one_hot(target, 1024).float()


def test_batched_scoring_matches_the_heldout_scorer():
    corpus = SyntheticCorpus(8, 128, seed=777, lengths=np.full(8, 128), fact_every=32, recalls=4)
    docs = [corpus.annotated(i) for i in range(8)]
    assert all(len(recalls) >= 3 for _, recalls in docs)
    perfect, em = pilot.value_token_accuracy(Oracle(set()), docs, rows=3)
    assert perfect == [1.0, 1.0, 1.0] and em == 1.0
    wrong = {int(docs[i][0].sum()) for i in (1, 4, 5)}
    acc, em = pilot.value_token_accuracy(Oracle(wrong), docs, rows=3)
    reference = score_heldout(Oracle(wrong), docs)
    assert em == reference.exact_match() == 5 / 8
    right = [(i not in (1, 4, 5), r.value_len) for i, (_, rs) in enumerate(docs) for r in rs]
    assert acc == [np.mean([ok for ok, n in right if n > j]) for j in range(3)]


def test_a_short_pilot_writes_its_curve(tmp_path, capsys, keep_torch_threads):
    out = tmp_path / "pilot.json"
    pilot.main(["--steps", "2", "--eval-every", "1", "--rows", "2", "--heldout", "4",
                "--out", str(out)])  # fmt: skip
    assert "value tokens 1/2/3" in capsys.readouterr().out
    (tag, result), *_ = json.loads(out.read_text()).items()
    assert tag == "debug4_L128_f32_r4" and [c["step"] for c in result["curve"]] == [1, 2]
    assert all(0 <= a <= 1 for c in result["curve"] for a in [*c["value_token_acc"], c["em"]])
