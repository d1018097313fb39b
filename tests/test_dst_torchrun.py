"""DST through the pipeline schedules, with real torchrun processes (CPU, gloo).

An attention recorder logs every attention call (forward, and when backward reaches
it) with the stage and micro-batch the schedule was running; the trainer logs the
plan's budget and rows per micro-batch (and with `[dst] per_document` each document's
budget). Every stage of every micro-batch must have computed with exactly the budgets
and document layout the plan gave that micro-batch.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_run_digest, sample_log, torchrun

from sb_titan.runtime.tensorboard import read_layout, read_scalars

pytestmark = pytest.mark.torchrun

DST = [
    "--dst.enabled",
    "--dst.verify_ranks",
    "--dst.beta0",
    "0.6",
    "--dst.beta_min",
    "0.2",
    "--dst.p",
    "0.05",
    "--cost_model.analytic_device",
    "cpu",
    "--sparse_attention.policy",
    "topk",
    "--sparse_attention.record",
    "--dataloader.sample_log",
    "--training.steps",
    "2",
]


def _records(dump: Path, rank: int) -> list[dict]:
    path = dump / f"attention_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _expected_layout(rows: list, seq_len: int) -> list[list[int]]:
    out = []
    for row in rows:
        lens = [length for _, _, length in row]
        pad = seq_len - sum(lens)
        out.append(lens + [1] * pad)  # every pad token is its own "document"
    return out


def _expected_block_budgets(entry: dict, seq_len: int, block_size: int) -> list[list[float]]:
    """[B, NB] budget of every query block from the sample log alone: the micro-batch's
    DST budget; with per-document budgets, that of the document holding the block's
    first token (padding: the row's last document's, a row of padding only the
    micro-batch's last)."""
    blocks = seq_len // block_size
    if "doc_budgets" not in entry:
        return [[entry["budget"]] * blocks for _ in entry["rows"]]
    flat, out = iter(entry["doc_budgets"]), []
    for row in entry["rows"]:
        ends, betas, end = [], [], 0
        for _, _, length in row:
            end += length
            ends.append(end)
            betas.append(next(flat))
        last = (betas or entry["doc_budgets"])[-1]
        docs = list(zip(ends, betas, strict=True))
        first_tokens = [j * block_size for j in range(blocks)]
        out.append([next((b for e, b in docs if t < e), last) for t in first_tokens])
    assert next(flat, None) is None, "more document budgets than documents"
    return out


def _check_every_stage(dump: Path, ranks: list[int], seq_len: int, block_size: int = 64) -> set:
    plan = {}  # (step, microbatch) -> (block budgets, layout); PP ranks share DP rank 0
    for entry in sample_log(dump, 0):
        plan[(entry["step"], entry["microbatch"])] = (
            _expected_block_budgets(entry, seq_len, block_size),
            _expected_layout(entry["rows"], seq_len),
        )
    seen = defaultdict(set)
    for rank in ranks:
        for rec in _records(dump, rank):
            key = (rec["step"], rec["microbatch"])
            assert rec["schedule_microbatch"] == rec["microbatch"], rec
            budgets, layout = plan[key]
            # [B, NB]: one budget per query block (attention/layout.block_budgets)
            assert rec["budget"] == [[pytest.approx(b) for b in row] for row in budgets], rec
            assert rec["doc_lens"] == layout, rec
            seen[(rec["stage"], rec["phase"])].add(key)
    stages = {stage for stage, _ in seen}
    assert len(stages) >= 2
    for stage in stages:  # forward and backward of every micro-batch on every stage
        assert seen[(stage, "forward")] == set(plan), stage
        assert seen[(stage, "backward")] == set(plan), stage
    return {b for budgets, _ in plan.values() for row in budgets for b in row}


PER_DOCUMENT = ["--dst.per_document", "--dst.long_tokens", "256", "--dst.long_floor", "0.6"]


@pytest.mark.parametrize(
    ("schedule", "extra"),
    [
        ("1F1B", []),
        # each document its own budget (documents of 256+ tokens keep at least 0.6):
        # every stage must compute each query block at its document's. 5 steps over 12
        # samples, so that they come back and carry the recall they measured 3 steps before
        (
            "GPipe",
            [*PER_DOCUMENT, "--sab.observe_lag", "3", "--dataloader.synthetic_docs", "12"]
            + ["--training.steps", "5"],
        ),
        # 4 virtual stages on 2 ranks: embeddings | layer 0 | layer 1 | norm + head
        ("Interleaved1F1B", ["--parallelism.pipeline_parallel_layers_per_stage", "1"]),
    ],
)
def test_pp_every_stage_uses_the_plans_budget_and_layout(tmp_path, schedule, extra):
    torchrun(
        2,
        [
            *DST,
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            schedule,
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
            "--training.local_batch_size",
            "4",
            *extra,
        ],
        tmp_path,
    )
    budgets = _check_every_stage(tmp_path, [0, 1], seq_len=512)
    assert len(budgets) > 1, "DST should give the micro-batches different budgets"
    if "--dst.per_document" in extra:  # each rank logged each document's budget
        logs = [sample_log(tmp_path, rank) for rank in (0, 1)]
        assert all("doc_budgets" in e for log in logs for e in log)
        assert [e["doc_budgets"] for e in logs[0]] == [e["doc_budgets"] for e in logs[1]]
        within = [len(set(e["doc_budgets"])) > 1 for e in logs[0]]
        assert any(within), "per-document budgets should differ within a micro-batch"
        _check_document_recalls(logs[0], lag=3, seq_len=512, block_size=64)


def _check_document_recalls(log: list[dict], lag: int, seq_len: int, block_size: int) -> None:
    """Each document planned after its sample trained carries the budget that sample's
    document trained with in the latest step at least `lag` steps before (from the same
    log; stored as float32), what its sensitive tokens kept, and the weight of its
    sampled blocks; every
    rank computed them from the same gathered sums (the rank check hashes the budgets
    they chose)."""
    trained: dict[int, list[tuple[int, float, int]]] = defaultdict(list)  # sample -> ...
    carried = 0
    for e in sorted(log, key=lambda e: (e["plan_step"], e["microbatch"])):
        pieces = [p for row in e["rows"] for p in row]
        for d, (sample, _, length) in enumerate(pieces):
            seen = (e.get("doc_recalls") or [None] * len(pieces))[d]
            earlier = [t for t in trained[sample] if t[0] <= e["plan_step"] - lag]
            sensitive = (length - 2 * block_size) // block_size  # its blocks past the sink
            if seen is not None:
                _, budget, measured_length = earlier[-1]
                blocks = max(measured_length - 2 * block_size, 0) / block_size
                assert seen[0] == float(np.float32(budget)), (e["plan_step"], sample, seen)
                assert 0 < seen[1] <= 1
                assert seen[2] == pytest.approx(blocks / (blocks + 8.0), rel=1e-6)
                carried += 1
            elif earlier and sensitive > 0 and earlier[-1][2] == length:
                raise AssertionError(f"sample {sample} came back without its recall: {e}")
            trained[sample].append((e["plan_step"], e["doc_budgets"][d], length))
    assert carried > 0, "no document came back with its measured recall"


@pytest.mark.parametrize("policy", ["sequential", "sab"])
def test_dp_ranks_agree_on_every_plan_and_budget(tmp_path, policy):
    torchrun(
        2,
        [
            *DST,
            "--sab.policy",
            policy,
            "--training.local_batch_size",
            "1",
            "--training.global_batch_size",
            "4",
        ],
        tmp_path,
        fixture="deterministic_clock",
    )
    a, b = sample_log(tmp_path, 0), sample_log(tmp_path, 1)
    assert [e["plan_digest"] for e in a] == [e["plan_digest"] for e in b]  # same global plan
    assert [e["step_budgets"] for e in a] == [e["step_budgets"] for e in b]
    budgets = {x for e in a for rank in e["step_budgets"] for x in rank}
    if policy == "sequential":  # unbalanced plans: DST moves budgets (SAB may leave none)
        assert len(budgets) > 1
    for rank, log in ((0, a), (1, b)):  # each rank trains its own row of the vector
        for e in log:
            assert e["budget"] == e["step_budgets"][rank][e["microbatch"]]
    _check_layout(tmp_path)
    assert_run_digest(f"dp2_{policy}_dst", tmp_path, ranks=2)


def _check_layout(dump: Path) -> None:
    """The run's TensorBoard folder holds the Custom Scalars layout, and every line of
    every chart is a scalar this run logged."""
    layout = read_layout(dump)
    assert list(layout) == [
        "SparseBalance: balance",
        "SparseBalance: budgets",
        "SparseBalance: sparsity",
        "SparseBalance: cost model",
    ]
    logged = set(read_scalars(dump))
    for category, charts in layout.items():
        for title, patterns in charts.items():
            for pattern in patterns:
                hits = [tag for tag in logged if re.fullmatch(pattern, tag)]
                assert len(hits) == 1, (category, title, pattern, hits)
    (budgets,) = layout["SparseBalance: budgets"].values()
    assert [p.strip("^$") for p in budgets] == [f"dst/budget_{s}" for s in ("min", "mean", "max")]
