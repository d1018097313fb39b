"""End-to-end training with real torchrun processes on CPU (gloo).

All runs start from one seed checkpoint, so runs with different parallel layouts
(1 process, FSDP, PP) start from the same weights and can be compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import losses, sample_log, torchrun

pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def seed_ckpt(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("seed")
    torchrun(
        1,
        ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--training.steps", "1"],
        dump,
    )
    step0 = dump / "checkpoint" / "step-0"
    assert step0.is_dir()
    return step0


def _from_seed(seed_ckpt: Path, steps: int) -> list[str]:
    return [
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1000",
        "--checkpoint.initial_load_path",
        str(seed_ckpt),
        "--training.steps",
        str(steps),
    ]


@pytest.fixture(scope="module")
def single(seed_ckpt, tmp_path_factory) -> list[float]:
    dump = tmp_path_factory.mktemp("single")
    torchrun(1, _from_seed(seed_ckpt, 5), dump)
    return losses(dump)


def test_single_process_loss_decreases(single):
    assert len(single) == 5
    assert single[-1] < single[0] - 0.1, single


def test_fsdp_two_processes_loss_decreases(seed_ckpt, tmp_path):
    torchrun(2, _from_seed(seed_ckpt, 5), tmp_path)
    loss = losses(tmp_path)
    assert len(loss) == 5 and loss[-1] < loss[0] - 0.1, loss


def test_pp_1f1b_matches_single_process_first_step(seed_ckpt, single, tmp_path):
    # Same rows as the single-process run (2 rows = 2 micro-batches of 1 row), same weights.
    torchrun(
        2,
        [
            *_from_seed(seed_ckpt, 5),
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
        ],
        tmp_path,
    )
    loss = losses(tmp_path)
    assert len(loss) == 5 and loss[-1] < loss[0] - 0.1, loss
    assert abs(loss[0] - single[0]) < 1e-4, (loss[0], single[0])


@pytest.mark.parametrize(
    "recipe",
    [
        [],
        # SAB + DST with density observations feeding the planner and the density model
        # (refit off: it learns from wall-clock times, which no resume can reproduce).
        [
            "--sab.policy",
            "sab",
            "--dst.enabled",
            "--cost_model.analytic_device",
            "cpu",
            "--cost_model.no-refit",
            "--sab.observe_lag",
            "4",
        ],
    ],
    ids=["baseline", "sab_dst"],
)
def test_resume_gives_same_losses_and_samples(seed_ckpt, tmp_path, recipe):
    # LR constant after warm-up (min_lr_factor 1), so a 3-step run schedules like a 6-step one.
    common = [
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.initial_load_path",
        str(seed_ckpt),
        "--lr_scheduler.warmup_steps",
        "2",
        "--lr_scheduler.min_lr_factor",
        "1.0",
        "--dataloader.sample_log",
        *recipe,
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    torchrun(1, [*common, "--training.steps", "6"], straight)
    torchrun(1, [*common, "--training.steps", "3"], resumed)
    torchrun(1, [*common, "--training.steps", "6"], resumed)
    a, b = losses(straight), losses(resumed)
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5, (a, b)
    assert sample_log(straight) == sample_log(resumed)
