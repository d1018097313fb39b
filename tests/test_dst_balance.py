"""DST on a deliberately imbalanced batch, real torchrun processes (DP=2, CPU).

Every step, rank 0 trains one 2048-token document (attention-heavy) and rank 1 a row
of 32 short documents. DST should lower rank 0's budget and raise rank 1's: the slowest
rank gets faster than with the static default budget, and the mean recall is not lower
than a static budget that gives the same step time (the idle rank buys recall).
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from conftest import sample_log, scalars, torchrun

from sb_titan.data.indexed import IndexedWriter

pytestmark = pytest.mark.torchrun

SEQ = 2048
STEPS = 6
CONFIG = """
[model]
flavor = "debug"
[sparse_attention]
policy = "topk"
dense_layers = []
[training]
seq_len = {seq}
local_batch_size = 1
steps = {steps}
mixed_precision_param = "float32"
[dataloader]
dataset = "indexed"
dataset_path = "{data}"
sample_log = true
[sab]
policy = "sequential"
shuffle = false
[cost_model]
analytic_device = "cpu"
[dst]
enabled = {dst}
beta0 = {beta0}
beta_min = 0.15
beta_max = 1.0
verify_ranks = true
[metrics]
log_freq = 1
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("imbalanced")
    rng = np.random.default_rng(0)
    writer = IndexedWriter(out)
    for _ in range(STEPS + 2):
        writer.add(rng.integers(3, 1000, SEQ))  # rank 0's row: one long document
        for _ in range(SEQ // 64):
            writer.add(rng.integers(3, 1000, 64))  # rank 1's row: short documents
    writer.close({"tokenizer": "random ids", "source": "tests"})
    return out


def _run(tmp_path, data, name: str, dst: bool, beta0: float):
    dump = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(
        CONFIG.format(seq=SEQ, steps=STEPS, data=data, dst=str(dst).lower(), beta0=beta0)
    )
    torchrun(
        2,
        ["--training.seq_len", str(SEQ), "--training.local_batch_size", "1"],
        dump,
        config=cfg,
        timeout=600,
    )
    after_warmup = lambda tag: [v for s, v in sorted(scalars(dump, tag).items()) if s > 1]
    return {
        "slowest": statistics.median(after_warmup("balance/rank_compute_max_s")),
        "recall": statistics.mean(after_warmup("sparsity/recall")),
        "budgets": sample_log(dump, 0)[-1]["step_budgets"],
    }


def test_dst_speeds_up_the_slowest_rank_and_keeps_recall(tmp_path, data):
    static = _run(tmp_path, data, "static", dst=False, beta0=0.9)
    tuned = _run(tmp_path, data, "dst", dst=True, beta0=0.9)
    (b_heavy,), (b_light,) = tuned["budgets"]
    assert b_heavy < 0.9 < b_light or b_light == 1.0, tuned["budgets"]
    # Measured compute: 0.74x on a quiet machine, 0.85x with another test suite running
    # beside it; 0.9 keeps the check (DST must make the slowest rank faster) off the noise.
    assert tuned["slowest"] < 0.9 * static["slowest"], (tuned, static)
    # A static budget at the heavy rank's DST budget gives about the same step time;
    # DST's recall must not be lower (rank 1 trained denser for free).
    matched = _run(tmp_path, data, "matched", dst=False, beta0=b_heavy)
    assert tuned["recall"] >= matched["recall"] - 1e-6, (tuned, matched)
