"""DST through the pipeline schedules, with real torchrun processes (CPU, gloo).

An attention recorder logs every attention call (forward, and when backward reaches
it) with the stage and micro-batch the schedule was running; the trainer logs the
plan's budget and rows per micro-batch. Every stage of every micro-batch must have
computed with exactly the budget and document layout the plan gave that micro-batch.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import assert_run_digest, fixture_env, sample_log, torchrun

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


def _check_every_stage(dump: Path, ranks: list[int], seq_len: int) -> set[float]:
    plan = {}  # (step, microbatch) -> (budget, layout); PP ranks share DP rank 0
    for entry in sample_log(dump, 0):
        plan[(entry["step"], entry["microbatch"])] = (
            entry["budget"],
            _expected_layout(entry["rows"], seq_len),
        )
    seen = defaultdict(set)
    for rank in ranks:
        for rec in _records(dump, rank):
            key = (rec["step"], rec["microbatch"])
            assert rec["schedule_microbatch"] == rec["microbatch"], rec
            budget, layout = plan[key]
            # [B, NB]: one budget per query block (attention/layout.block_budgets), and
            # DST decides one per micro-batch, so every block of every row has it
            assert rec["budget"] and all(
                row == [pytest.approx(budget)] * len(row) for row in rec["budget"]
            ), rec
            assert rec["doc_lens"] == layout, rec
            seen[(rec["stage"], rec["phase"])].add(key)
    stages = {stage for stage, _ in seen}
    assert len(stages) >= 2
    for stage in stages:  # forward and backward of every micro-batch on every stage
        assert seen[(stage, "forward")] == set(plan), stage
        assert seen[(stage, "backward")] == set(plan), stage
    return {budget for budget, _ in plan.values()}


@pytest.mark.parametrize(
    ("schedule", "extra"),
    [
        ("1F1B", []),
        ("GPipe", []),
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
        env=fixture_env("deterministic_clock"),
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
