"""torch.distributed.pipelining internals: the pre-split `step(arg_mbs=, kwarg_mbs=,
target_mbs=)` TorchTitan calls (missing before torch 2.14), and a built schedule's
settings, which torch keeps in private attributes."""

from __future__ import annotations

import inspect
from typing import Any

from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineSchedule


def torch_schedule_class(cls: type) -> type:
    """The torch schedule a recipe subclass derives from."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("torch.distributed.pipelining"))


def has_presplit_step(schedule_cls: type) -> bool:
    return "arg_mbs" in inspect.signature(torch_schedule_class(schedule_cls).step).parameters


def presplit_step(
    schedule: _PipelineSchedule, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs
):
    """Backport of torch 2.14's pre-split step() onto an older schedule."""
    stages = stages_of(schedule)
    for stage in stages:
        stage.has_backward = schedule._has_backward
        stage.clear_runtime_states()
    schedule._step_microbatches(
        arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
    )
    for stage in stages:
        if stage.is_last and return_outputs:
            return schedule._merge_outputs(stage.output_chunks)
    return None


def stages_of(schedule: _PipelineSchedule) -> list:
    """The stages this rank runs, for single- and multi-stage schedules alike."""
    if isinstance(schedule, PipelineScheduleMulti):
        return list(schedule._stages)
    return [schedule._stage]


def schedule_settings(schedule: _PipelineSchedule) -> tuple[Any, dict[str, Any]]:
    """(stages argument, keyword settings) to build another schedule class like it."""
    common = dict(
        n_microbatches=schedule._n_microbatches,
        loss_fn=schedule._loss_fn,
        scale_grads=schedule.scale_grads,
    )
    if isinstance(schedule, PipelineScheduleMulti):
        return list(schedule._stages), common
    return schedule._stage, common
