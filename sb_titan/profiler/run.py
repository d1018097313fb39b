"""Measuring one pipeline stage on this device into a cost-model Profile (`sb-profile`).

The cost model (sb_titan/balance/cost_model/) predicts a micro-batch's fwd+bwd seconds as
overhead + linear(tokens) + sum over documents of attn(L, rho). This module measures
those terms on the device it runs on, for the stage the trainer runs:

  * attention: the stage's inner attention (dense layers, estimator and selection
    included), fwd+bwd on `rows` rows of `row_len` tokens packed with k copies of an
    L-token document at topk budget rho, divided by k. One layer of each kind (dense,
    sparse) is timed and multiplied by how many the stage has: they do identical work.
  * linear: the stage with its inner attention swapped for an O(tokens) stand-in, at
    several token counts; a fitted line's intercept is the overhead.

`scope` says what "the stage" is. `blocks` (default): its decoder blocks only, which is
what the trainer's clock measures (sb_titan/runtime/measure.py), so the online refit compares
like with like. `stage`: also the embedding, final norm, output head and loss where the
stage holds them. All grid points, attention and linear, are timed round-robin (each
point once per pass), so a change in machine load spreads over the whole profile
instead of bending the part that happened to be timed during it.
docs/cost_model.md ("Measuring a profile") gives the reasons for each choice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Unpack

import numpy as np
import torch
import torch.nn as nn
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.models.qwen3.model import Qwen3Model

from sb_titan.balance.cost_model import CostModel, Profile
from sb_titan.balance.cost_model.options import CostModelOptions
from sb_titan.models.attention import SBAttention
from sb_titan.profiler.fingerprint import current_fingerprint
from sb_titan.profiler.inputs import (
    AttentionInputs,
    make_attention_step,
    make_stage_step,
    packed_rows,
)
from sb_titan.profiler.sections import CheckedSections, ProfiledSections
from sb_titan.profiler.stage import (
    PROFILE_POLICY,
    SCOPES,
    ProfilerError,
    TokenLinearAttention,
    attention_kinds,
    attention_swapped,
    build_stage,
    check_supported,
    scoped_modules,
    stage_module_names,
)
from sb_titan.profiler.timing import CLOCKS, Progress, load_average, time_grid
from sb_titan.util.files import write_atomic

logger = logging.getLogger(__name__)


DEFAULT_DENSITIES = (0.1, 0.25, 0.5, 1.0)


LINEAR_FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # token grid: these shares of a micro-batch


MIN_LENGTH = 16  # the shortest document the data pipeline emits (longtail-v1 MIN_LEN)


@dataclass(frozen=True, slots=True)
class ProfileSettings:
    """What to measure: grids, micro-batch shape, repetition, clock."""

    lengths: tuple[int, ...]
    densities: tuple[float, ...] = DEFAULT_DENSITIES
    rows: int = 2
    row_len: int = 4096
    repeats: int = 5
    warmup: int = 1
    clock: str = "wall"
    """`wall`, or `cpu` (process CPU time; CPU device with one thread only)."""
    scope: str = "blocks"

    def __post_init__(self) -> None:
        lengths = list(self.lengths)
        if len(lengths) < 2 or lengths != sorted(set(lengths)):
            raise ProfilerError(f"--lengths: need >= 2 increasing values, got {lengths}")
        bad = [n for n in lengths if n < 1 or self.row_len % n]
        if bad:
            raise ProfilerError(
                f"--lengths {bad}: every length must divide the row length "
                f"(training.seq_len = {self.row_len}); a row holds copies of one document"
            )
        dens = list(self.densities)
        if len(dens) < 2 or dens != sorted(set(dens)) or dens[0] <= 0 or dens[-1] != 1.0:
            raise ProfilerError(
                f"--densities: need >= 2 increasing values in (0, 1] ending at 1.0, got {dens}"
            )
        if self.rows < 1 or self.repeats < 1 or self.warmup < 0:
            raise ProfilerError("need rows >= 1, repeats >= 1, warmup >= 0")
        if self.clock not in CLOCKS:
            raise ProfilerError(f"--clock: {self.clock!r} is not one of {CLOCKS}")
        if self.scope not in SCOPES:
            raise ProfilerError(f"--scope: {self.scope!r} is not one of {SCOPES}")


def default_lengths(row_len: int, block_size: int) -> tuple[int, ...]:
    """MIN_LENGTH, then powers of two from one block up to the row length (each rounded
    down to a divisor of the row length, since a row holds copies of one document).

    Lengths below one block matter: short documents share blocks, so they cost less
    than the one block pair the cost model's below-grid rule would charge.
    """
    targets = [MIN_LENGTH] if MIN_LENGTH < block_size else []
    n = block_size
    while n < row_len:
        targets.append(n)
        n *= 2
    divisors = [d for d in range(1, row_len + 1) if row_len % d == 0]
    return tuple(sorted({max(d for d in divisors if d <= t) for t in [*targets, row_len]}))


def at_nominal(
    realised: Sequence[float], seconds: Sequence[float], grid: Sequence[float]
) -> list[float]:
    """Seconds at the grid's densities from seconds measured at realised densities.

    topk keeps at least the sink and diagonal blocks, so short documents realise more
    than the requested density; the table must still mean "seconds at density rho".
    Piecewise linear in the realised density, flat below the least realised one.
    """
    r, s = np.asarray(realised, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    order = np.argsort(r, kind="stable")
    r, s = r[order], s[order]
    r, first = np.unique(r, return_index=True)  # equal realised density: same work
    s = np.array([np.median(x) for x in np.split(s, first[1:])])
    return np.interp(np.asarray(grid, dtype=np.float64), r, s).tolist()


def fit_linear(tokens: Sequence[int], seconds: Sequence[float]) -> tuple[float, list[float]]:
    """(overhead, linear_seconds): a least-squares line's intercept (clamped at 0), and
    each measurement minus it (the contract in docs/cost_model.md)."""
    _, intercept = np.polyfit(np.asarray(tokens, float), np.asarray(seconds, float), 1)
    overhead = max(float(intercept), 0.0)
    return overhead, [max(float(s) - overhead, 0.0) for s in seconds]


@dataclass
class AttentionGrid:
    """The attention grid's points: (kind, length, budget), closures, realised densities."""

    kinds: list[tuple[SBAttention, int]]
    points: list[tuple[int, int, float]]
    steps: list[Callable[[], None]]
    realised: list[float]


def attention_grid(
    model: nn.Module, config: ProfiledSections, settings: ProfileSettings, device: torch.device
) -> AttentionGrid:
    """One point per (kind, length, budget); a dense layer needs one budget (no effect)."""
    kinds = attention_kinds(model)
    points = []
    for k, (module, _) in enumerate(kinds):
        budgets = settings.densities if module.config.sparse else (1.0,)
        points += [(k, n, rho) for n in settings.lengths for rho in budgets]
    inputs = AttentionInputs.random(config.training, model, settings.rows, settings.row_len, device)
    shift = config.sparse_attention.block_size // 2
    built = [
        make_attention_step(
            kinds[k][0], inputs, packed_rows(n, settings.rows, settings.row_len, shift), rho
        )
        for k, n, rho in points
    ]
    return AttentionGrid(kinds, points, [b[0] for b in built], [b[1] for b in built])


def attention_table(grid: AttentionGrid, times, settings: ProfileSettings) -> tuple[list, list]:
    """attn_seconds[i][j] = sum over kinds of layers * seconds(L_i, rho_j) / copies."""
    table = np.zeros((len(settings.lengths), len(settings.densities)))
    raw = []
    for k, (module, count) in enumerate(grid.kinds):
        mine = [p for p, point in enumerate(grid.points) if point[0] == k]
        per_len = len(mine) // len(settings.lengths)
        for i, n in enumerate(settings.lengths):
            copies = settings.rows * settings.row_len // n
            idx = mine[i * per_len : (i + 1) * per_len]
            secs = [statistics.median(times[p]) / copies for p in idx]
            real = [grid.realised[p] for p in idx]
            table[i] += count * np.asarray(at_nominal(real, secs, settings.densities))
            raw.append(
                {
                    "kind": "sparse" if module.config.sparse else "dense",
                    "layers": count,
                    "length": n,
                    "copies": copies,
                    "budgets": [grid.points[p][2] for p in idx],
                    "realised_density": real,
                    "seconds_per_doc_and_layer": secs,
                }
            )
    return table.tolist(), raw


def linear_grid(
    model: nn.Module, training: TrainingConfig, settings: ProfileSettings, device: torch.device
) -> tuple[list[int], list[Callable[[], None]]]:
    """The stage with the O(tokens) stand-in attention at LINEAR_FRACTIONS of a
    micro-batch (shorter rows, so the largest point is the micro-batch itself)."""
    stand_in = TokenLinearAttention()
    tokens, steps = [], []
    for frac in LINEAR_FRACTIONS:
        row_len = max(MIN_LENGTH, round(settings.row_len * frac))
        tokens.append(settings.rows * row_len)
        step = make_stage_step(model, training, [[row_len]] * settings.rows, 1.0, device)

        def swapped(step=step) -> None:
            with attention_swapped(model, stand_in):
                step()

        steps.append(swapped)
    return tokens, steps


@dataclass
class ProfileRun:
    profile: Profile
    measurement: dict[str, Any]


def run_profile(
    config: ProfiledSections,
    model_cfg: Qwen3Model.Config,
    settings: ProfileSettings,
    stage: int = 0,
    device: torch.device | None = None,
    progress: bool = True,
) -> ProfileRun:
    """Measure stage `stage` of `model_cfg` (the model spec's, derived from `config`) on
    `device` (default: CUDA if present)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if settings.clock == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise ProfilerError("--clock cpu needs the CPU device and one thread (--threads 1)")
    modules = scoped_modules(
        stage_module_names(config.parallelism, model_cfg, stage), settings.scope
    )
    check_supported(config.model.flavor, model_cfg, modules, device)
    fingerprint = current_fingerprint(config, model_cfg, stage, device, settings.scope)
    fingerprint["row_len"] = settings.row_len
    fingerprint["policy"] = PROFILE_POLICY
    model = build_stage(config.training, model_cfg, modules, device)
    kinds = attention_kinds(model)
    n_points = len(LINEAR_FRACTIONS) + sum(
        len(settings.lengths) * (len(settings.densities) if m.config.sparse else 1)
        for m, _ in kinds
    )
    bar = Progress(n_points * (settings.warmup + settings.repeats), "sb-profile", progress)
    t0, load_before = time.perf_counter(), load_average()
    grid = attention_grid(model, config, settings, device)
    tokens, linear_steps = linear_grid(model, config.training, settings, device)
    try:  # one round-robin over both grids: they share every pass's machine state
        times = time_grid(
            grid.steps + linear_steps,
            device,
            settings.warmup,
            settings.repeats,
            bar,
            settings.clock,
        )
    finally:
        bar.close()
    table, attention_points = attention_table(grid, times[: len(grid.steps)], settings)
    linear = [statistics.median(t) for t in times[len(grid.steps) :]]
    overhead, linear_seconds = fit_linear(tokens, linear)
    profile = Profile(
        fingerprint=fingerprint,
        block_size=config.sparse_attention.block_size,
        lengths=list(settings.lengths),
        densities=[float(d) for d in settings.densities],
        attn_seconds=table,
        linear_tokens=tokens,
        linear_seconds=linear_seconds,
        overhead_seconds=overhead,
    )
    measurement = {
        "settings": dataclasses.asdict(settings),
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "load_avg_1min": [load_before, load_average()],
        "linear_measured_seconds": linear,
        "attention_points": attention_points,
    }
    return ProfileRun(profile, measurement)


def write_profile(run: ProfileRun, path: str | os.PathLike) -> None:
    """Atomic write of the profile plus a `measurement` record (the loader ignores it)."""
    data = {**run.profile.to_dict(), "measurement": run.measurement}
    write_atomic(path, json.dumps(data, indent=1) + "\n")


def load_cost_model(
    path: str | os.PathLike,
    config: CheckedSections | None = None,
    model_cfg: Qwen3Model.Config | None = None,
    stage: int = 0,
    strict: bool = False,
    **kwargs: Unpack[CostModelOptions],
) -> CostModel:
    """Read the profile (ProfileError names the file) and, given the run's config and
    the model its spec builds, check its fingerprint as a training run does: another
    model shape raises unless `config.cost_model.allow_shape_mismatch`, other differences
    warn (raise under strict)."""
    model = CostModel.from_file(path, **kwargs)
    if config is not None:
        expected = current_fingerprint(config, model_cfg, stage)
        model.check_fingerprint(expected, strict, config.cost_model.allow_shape_mismatch)
    return model


def microbatch_rows(p: ParallelismConfig, training: TrainingConfig) -> int:
    """Rows per micro-batch as the trainer forms them."""
    if p.pipeline_parallel_degree > 1:
        return p.pipeline_parallel_microbatch_size
    return training.local_batch_size
