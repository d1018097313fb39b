"""Per-step measurements travel as one float64 tensor per rank: encoding, all-gathering
and decoding must hand every rank exactly the values each rank measured."""

from __future__ import annotations

import random

import pytest
import torch

from sb_titan.attention.selection import STATS_SIZE
from sb_titan.balance.measurements import StepMeasurements
from sb_titan.balance.sab import MicroBatchPlan, Piece, StepPlan
from sb_titan.runtime.measurements import (
    decode_measurements,
    encode_measurements,
    measurement_size,
)


def _local(dp: int, pp: int, mbs: list[int], rng: random.Random, cp: int = 0) -> dict:
    """What SBTrainer._local_measurements returns: timed micro-batches, fp32 stats
    (through .tolist(), as the trainer reads them) for those with rows > 0."""
    stats = torch.rand(len(mbs), STATS_SIZE, dtype=torch.float32) * 1e4
    stats[:, 1] = torch.arange(1, len(mbs) + 1)
    if mbs:
        stats[0, 1] = 0.0  # a micro-batch without sparse rows has no stats entry
    return {
        "dp": dp,
        "pp": pp,
        "cp": cp,
        "seconds": {mb: rng.random() / 7 for mb in mbs},
        "stats": {mb: v for mb, v in zip(mbs, stats.tolist(), strict=True) if v[1] > 0},
        "step_seconds": rng.random() * 3,
    }


def test_round_trip_is_exact_with_absent_microbatches():
    rng = random.Random(0)
    n = 5
    # 2 DP x 2 PP ranks; the stages of DP rank 1 see different subsets; one rank saw none.
    local = [
        _local(0, 0, [0, 1, 2, 3, 4], rng),
        _local(0, 1, [], rng),
        _local(1, 0, [0, 2, 4], rng),
        _local(1, 1, [1, 3], rng),
    ]
    encoded = [encode_measurements(x, n) for x in local]
    assert all(e.dtype == torch.float64 and e.numel() == measurement_size(n) for e in encoded)
    decoded = decode_measurements(torch.cat(encoded), n)
    assert decoded == local  # == on floats: bit-exact, and absent stays absent
    for got, want in zip(decoded, local, strict=True):
        assert list(got["seconds"]) == list(want["seconds"])  # same order: same sums
        assert all(type(k) is int for k in (*got["seconds"], *got["stats"]))
        assert [x.hex() for v in got["stats"].values() for x in v] == [
            x.hex() for v in want["stats"].values() for x in v
        ]
    plan = StepPlan(
        step=0,
        epoch=0,
        microbatches=[[MicroBatchPlan(rows=[[Piece(i, 0, 64 * (i + 1))]]) for i in range(n)]] * 2,
    )
    budgets = [[0.5] * n, [0.7] * n]
    a = StepMeasurements.from_gathered(decoded, plan, budgets)
    b = StepMeasurements.from_gathered(local, plan, budgets)
    assert a == b and a.metrics() == b.metrics()
    assert set(a.seconds) == {(0, m) for m in range(n)} | {(1, m) for m in range(n)}


def test_bad_measurements_name_the_problem():
    rng = random.Random(1)
    with pytest.raises(ValueError, match="micro-batch 3: expected 0..2"):
        encode_measurements(_local(0, 0, [3], rng), 3)
    x = encode_measurements(_local(0, 0, [0, 1], rng), 2)
    with pytest.raises(ValueError, match="50 values, not a multiple of 35"):
        decode_measurements(torch.cat([x, x]), 3)
    x[4] = 3.0  # a rank that sized its buffer for another step shape
    with pytest.raises(ValueError, match="rank sent 3 micro-batches per step, expected 2"):
        decode_measurements(x, 2)


def test_context_parallel_ranks_add_up_and_report_their_imbalance():
    """Two CP ranks of one stage: their density partial sums and half-rows add up to the
    micro-batch's density; the kept-pair imbalance is max/mean of the partials."""
    # density part, rows / 2, recall sum, tokens, true recall sum, top-key hits, samples
    shards = [[0.3, 0.5, 2.0, 10.0, 3.0, 2.0, 4.0], [0.1, 0.5, 1.0, 6.0, 1.5, 1.0, 2.0]]
    local = [
        {"dp": 0, "pp": 0, "cp": r, "seconds": {0: 0.5 + r}, "stats": {0: v}, "step_seconds": 2.0}
        for r, v in enumerate(shards)
    ]
    gathered = decode_measurements(torch.cat([encode_measurements(x, 1) for x in local]), 1)
    plan = StepPlan(step=0, epoch=0, microbatches=[[MicroBatchPlan(rows=[[]])]])
    m = StepMeasurements.from_gathered(gathered, plan, [[0.9]])
    assert m.density[(0, 0)] == pytest.approx(0.4)  # (0.3 + 0.1) / (0.5 + 0.5)
    assert m.recall[(0, 0)] == (3.0, 16.0)
    assert m.seconds[(0, 0)] == 1.5  # the slower CP rank
    assert m.metrics()["balance/cp_kept_imbalance"] == pytest.approx(0.3 / 0.2)
    # each CP rank samples its own query blocks: the sums add up over the shards
    assert m.metrics()["sparsity/true_recall"] == pytest.approx(4.5 / 6.0)
    assert m.metrics()["sparsity/top_key_hit"] == pytest.approx(3.0 / 6.0)


def test_document_sums_travel_padded_to_the_fullest_dp_rank_and_add_over_stages():
    """Per-document sampled sums ([dst] doc_history): DP rank 0 has micro-batches of 2 and
    1 documents, rank 1 one of 4 (every rank sends room for 4); rank 0's two PP stages
    each measured their own layers, and the sums add up per document."""
    counts = [[2, 1], [4, 0]]
    stage0 = {0: [[1.0, 1.0, 2.0, 3.0, 4.0], [0.5, 0.0, 1.0, 1.0, 2.0]], 1: [[2.0] * 5]}
    stage1 = {0: [[0.25, 1.0, 2.0, 1.0, 4.0], [0.0] * 5]}  # micro-batch 1 not run here
    rank1 = {0: [[float(i), 0.0, 1.0, 2.0, 2.0] for i in range(4)], 1: []}
    local = [
        {"dp": 0, "pp": 0, "seconds": {}, "stats": {}, "step_seconds": 1.0, "doc_sums": stage0},
        {"dp": 0, "pp": 1, "seconds": {}, "stats": {}, "step_seconds": 1.0, "doc_sums": stage1},
        {"dp": 1, "pp": 0, "seconds": {}, "stats": {}, "step_seconds": 1.0, "doc_sums": rank1},
    ]
    encoded = [encode_measurements(x, 2, counts) for x in local]
    assert all(e.numel() == measurement_size(2) + 5 * 4 for e in encoded)
    gathered = decode_measurements(torch.cat(encoded), 2, counts)
    assert gathered[0]["doc_sums"] == stage0
    assert gathered[1]["doc_sums"] == {**stage1, 1: [[0.0] * 5]}  # absent: zeros
    assert gathered[2]["doc_sums"] == rank1
    piece = Piece(0, 0, 64)
    mbs = [[MicroBatchPlan(rows=[[piece] * n]) for n in rank] for rank in counts]
    m = StepMeasurements.from_gathered(gathered, StepPlan(0, 0, mbs), [[0.5, 0.5]] * 2)
    assert m.doc_sums == {
        (0, 0): [(1.25, 2.0, 4.0, 4.0, 8.0), (0.5, 0.0, 1.0, 1.0, 2.0)],
        (0, 1): [(2.0,) * 5],
        (1, 0): [(float(i), 0.0, 1.0, 2.0, 2.0) for i in range(4)],
    }  # micro-batch (1, 1) has no documents
    with pytest.raises(ValueError, match="micro-batch 0: expected 2 documents x 5 sums"):
        encode_measurements({**local[0], "doc_sums": {0: [[1.0] * 5]}}, 2, counts)
