"""Pipeline schedules that know which micro-batch each stage is running.

Subclasses of torch.distributed.pipelining's 1F1B, Interleaved1F1B, GPipe (and
ZBVZeroBubble) that
  * accept TorchTitan's pre-split `step(arg_mbs=, kwarg_mbs=, target_mbs=)` call
    (backported for torch < 2.14, sb_titan.compat.pipelining), and
  * run every stage's forward and backward of micro-batch i inside
    `run_context.microbatch(stage, i, phase)` (what the attention recorder reports).
Each micro-batch's attention metadata (document layout and budget, an AttnMeta) is in
`kwarg_mbs[i]`, which the schedule hands to every stage's forward; backward and
activation recomputation reuse what that forward saved, so every stage of every
micro-batch computes with exactly the budget the step's plan gave it (TorchTitan's
stock flow builds one mask per batch, which is wrong per micro-batch under PP).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torchtitan.protocols.model_spec import ModelSpec

from sb_titan.compat.pipelining import (
    ShapeInferenceHook,
    has_presplit_step,
    presplit_step,
    schedule_settings,
    stages_of,
)
from sb_titan.runtime.context import RunContext


class MicrobatchAwareSchedule(ShapeInferenceHook):
    """Mixin over a torch pipeline schedule; see the module docstring. The trainer
    replaces `run_context` with its own."""

    def __init__(self, *args, **kwargs) -> None:
        self.run_context = RunContext()
        super().__init__(*args, **kwargs)
        for stage in stages_of(self):
            stage.forward_one_chunk = self._wrapped(stage, stage.forward_one_chunk, "forward")
            stage.backward_one_chunk = self._wrapped(stage, stage.backward_one_chunk, "backward")

    def _wrapped(self, stage, fn, phase: str):
        def run(chunk_id: int, *args, **kwargs):
            with self.run_context.microbatch(stage.stage_index, chunk_id, phase):
                return fn(chunk_id, *args, **kwargs)

        return run

    def shape_inference(self):
        return self.run_context.paused()  # shape inference runs a forward: not a micro-batch

    def step(
        self,
        *args,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict | None = None,
        **kwargs,
    ):
        presplit = arg_mbs is not None or kwarg_mbs is not None or target_mbs is not None
        if not presplit:
            return super().step(
                *args,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
                **kwargs,
            )
        if has_presplit_step(type(self)):
            return super().step(
                arg_mbs=arg_mbs,
                kwarg_mbs=kwarg_mbs,
                target_mbs=target_mbs,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
            )
        return presplit_step(
            self, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs
        )


def _microbatch_aware(base: type) -> type:
    name = "SB" + base.__name__.removeprefix("Schedule")
    return type(name, (MicrobatchAwareSchedule, base), {"__module__": __name__})


SCHEDULES: dict[str, type] = {
    "1f1b": _microbatch_aware(Schedule1F1B),
    "gpipe": _microbatch_aware(ScheduleGPipe),
    "interleaved1f1b": _microbatch_aware(ScheduleInterleaved1F1B),
    "zbvzerobubble": _microbatch_aware(ScheduleZBVZeroBubble),
}


def rebuild_schedule(stock, name: str):
    """The recipe's subclass of `stock`, over the same stages and settings."""
    key = name.lower()
    if key not in SCHEDULES:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule: {name!r} is not supported by sb_titan; "
            f"expected one of {sorted(SCHEDULES)} (case-insensitive)"
        )
    stages, settings = schedule_settings(stock)
    return SCHEDULES[key](stages, **settings)


def with_microbatch_schedules(spec: ModelSpec) -> ModelSpec:
    """`spec` whose pipelining_fn swaps the stock schedule for the recipe's subclass
    (same stages, micro-batches, loss and scaling). The model layer keeps TorchTitan's
    stock split; the runtime, which owns the micro-batch context, adds this."""
    if spec.pipelining_fn is None:
        return spec
    stock_fn: Callable = spec.pipelining_fn

    def pipelining_fn(model, **kwargs):
        schedule, model_parts, has_first, has_last = stock_fn(model, **kwargs)
        name = kwargs["parallelism"].pipeline_parallel_schedule
        return rebuild_schedule(schedule, name), model_parts, has_first, has_last

    return dataclasses.replace(spec, pipelining_fn=pipelining_fn)
