"""Training under context parallelism with real torchrun processes (CPU, gloo): a CP
run computes the very loss and gradients of the same run without CP, composes with DP
and PP, and resumes bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import assert_run_digest, from_seed, sample_log, scalars, torchrun

pytestmark = pytest.mark.torchrun

# Sparse layers at a budget that drops blocks: 1024-token rows are 16 blocks.
SPARSE = [
    "--training.seq_len", "1024",
    "--dst.beta0", "0.5",
    "--sparse_attention.policy", "mass",
    "--cost_model.analytic_device", "cpu",
]  # fmt: skip
CP2 = ["--parallelism.context_parallel_degree", "2"]
PP2 = [
    "--parallelism.pipeline_parallel_degree", "2",
    "--parallelism.pipeline_parallel_schedule", "1F1B",
    "--parallelism.pipeline_parallel_microbatch_size", "1",
]  # fmt: skip


def _same_run(a, b, tol: float = 1e-5) -> None:
    """Losses and gradient norms of every step agree within `tol` (relative)."""
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        x, y = scalars(a, tag), scalars(b, tag)
        assert sorted(x) == sorted(y) and x, (tag, x, y)
        for step in x:
            assert abs(x[step] - y[step]) <= tol * abs(x[step]), (tag, step, x[step], y[step])


@pytest.fixture(scope="module")
def cp2_run(seed_ckpt, tmp_path_factory) -> Path:
    """3 steps of the sparse recipe at CP = 2 (the cost-balanced split; zigzag's
    attention is checked in test_context_parallel.py)."""
    dump = tmp_path_factory.mktemp("cp2")
    torchrun(2, [*from_seed(seed_ckpt, 3), *SPARSE, *CP2], dump)
    return dump


def test_cp2_trains_exactly_like_one_process(seed_ckpt, cp2_run, tmp_path):
    """CP = 2 gives the CP = 1 losses and gradient norms within 1e-5, with blocks really
    dropped, and logs the CP-rank imbalance, predicted and computed."""
    torchrun(1, [*from_seed(seed_ckpt, 3), *SPARSE], tmp_path)
    _same_run(tmp_path, cp2_run)
    density = scalars(cp2_run, "sparsity/density")
    assert density and max(density.values()) < 1.0
    # each CP rank samples true recall on its own query blocks: together, the row's
    for tag in ("sparsity/true_recall", "sparsity/top_key_hit"):
        one, cp2 = scalars(tmp_path, tag), scalars(cp2_run, tag)
        assert one and one.keys() == cp2.keys(), tag
        assert all(abs(one[s] - cp2[s]) < 1e-5 for s in one), (tag, one, cp2)
    for what in ("kept", "predicted"):
        ratio = scalars(cp2_run, f"balance/cp_{what}_imbalance")
        assert sorted(ratio) == [1, 2, 3] and all(1.0 <= v < 2.0 for v in ratio.values())


def test_cp2_compiled_tracks_eager(seed_ckpt, cp2_run, tmp_path):
    """--compile.enable under CP with full activation checkpointing (the forward runs
    again inside backward): the gathers, the shard's own autograd and selection with
    rows= trace into every block's graph (fullgraph, Dynamo and AOTAutograd), and train
    as eager does, with the same selection statistics. The graphs run with `aot_eager`
    (test_compile.py says where Inductor runs and why). Selection is discrete at budget
    0.5: a block whose estimated mass sits within float rounding of the cut could go
    either way, and would move the loss by that rounding's order, far below 1e-5
    (measured under Inductor: losses and gradient norms within 2.1e-7 relative, the same
    blocks kept); a wrong table, a missed gradient or a double-counted layer would cost
    far more."""
    args = [*from_seed(seed_ckpt, 3), *SPARSE, *CP2, "--compile.enable"]
    args += ["--compile.backend", "aot_eager", "activation-checkpoint:full"]
    proc = torchrun(2, args, tmp_path)
    log = proc.stdout + proc.stderr
    assert "Compiling each TransformerBlock" in log and "Applied FullAC activation" in log
    _same_run(tmp_path, cp2_run)
    for tag in ("sparsity/density", "sparsity/recall", "sparsity/true_recall"):
        eager, compiled = scalars(cp2_run, tag), scalars(tmp_path, tag)
        assert eager and eager.keys() == compiled.keys(), tag
        assert all(0 < eager[s] < 1 and abs(eager[s] - compiled[s]) < 1e-5 for s in eager)


@pytest.mark.parametrize("layout", ["dp", "pp"])
def test_cp2_composes_with_dp_and_pp(seed_ckpt, tmp_path, layout):
    """DP = 2 x CP = 2 and PP = 2 x CP = 2 on 4 processes train as DP = 2 / PP = 2 do."""
    args = [*from_seed(seed_ckpt, 2), *SPARSE, "--dataloader.sample_log"]
    if layout == "pp":
        args += [*PP2, "--training.local_batch_size", "2"]
    torchrun(2, args, tmp_path / "plain", timeout=600)
    torchrun(4, [*args, *CP2], tmp_path / "cp", timeout=600)
    _same_run(tmp_path / "plain", tmp_path / "cp")
    if layout == "dp":
        assert sample_log(tmp_path / "plain") == sample_log(tmp_path / "cp")


def test_cp2_resume_is_bit_exact(seed_ckpt, tmp_path):
    """SAB + DST with the refit cost model (on a deterministic clock) deciding the
    splits: a fresh folder holding only the step-2 checkpoint of 4 straight steps
    resumes to the straight run's steps 3 and 4, bit for bit. The straight run's plans
    and budgets (steps 2-3 from refit snapshots) are the recorded ones."""
    common = [
        *SPARSE, *CP2,
        "--checkpoint.enable", "--checkpoint.interval", "2",
        "--checkpoint.initial_load_path", str(seed_ckpt),
        "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.min_lr_factor", "1.0",
        "--sab.policy", "sab", "--dst.enabled", "--dataloader.sample_log",
        "--training.steps", "4",
    ]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    torchrun(2, common, straight, fixture="deterministic_clock")
    assert_run_digest("cp2_sab_dst_refit", straight, ranks=2)
    step2 = Path("checkpoint") / "step-2"
    shutil.copytree(straight / step2, resumed / step2)
    proc = torchrun(2, common, resumed, fixture="deterministic_clock")
    assert f"Loading the checkpoint from {resumed / step2}" in proc.stdout + proc.stderr
    loss = "loss_metrics/global_avg_loss"
    a, b = scalars(straight, loss), scalars(resumed, loss)
    assert sorted(a) == [1, 2, 3, 4] and b == {s: a[s] for s in (3, 4)}, (a, b)
    after = [e for e in sample_log(straight) if e["step"] > 2]
    assert after and sample_log(resumed) == after
