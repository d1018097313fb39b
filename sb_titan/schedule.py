"""Pipeline schedules that know which micro-batch each stage is running.

Subclasses of torch.distributed.pipelining's 1F1B, Interleaved1F1B, GPipe (and
ZBVZeroBubble) that
  * accept TorchTitan's pre-split `step(arg_mbs=, kwarg_mbs=, target_mbs=)` call
    (missing before torch 2.14), and
  * run every stage's forward and backward of micro-batch i inside a
    `MicrobatchContext(stage, i, phase)` (what the attention recorder reports).
Each micro-batch's attention metadata (document layout and budget, an AttnMeta) is in
`kwarg_mbs[i]`, which the schedule hands to every stage's forward; backward and
activation recomputation reuse what that forward saved, so every stage of every
micro-batch computes with exactly the budget the step's plan gave it (TorchTitan's
stock flow builds one mask per batch, which is wrong per micro-batch under PP).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
)

from sb_titan.models.qwen2_5.attention import measurement_paused


@dataclass(frozen=True, slots=True)
class MicrobatchContext:
    stage: int  # pipeline stage index (global), 0 without PP
    microbatch: int  # index within the step on this rank
    phase: str  # "forward" | "backward"


_current: list[MicrobatchContext] = []


def current_microbatch() -> MicrobatchContext | None:
    """The (stage, micro-batch, phase) being computed right now, if any."""
    return _current[-1] if _current else None


@contextlib.contextmanager
def microbatch_context(stage: int, microbatch: int, phase: str) -> Iterator[None]:
    _current.append(MicrobatchContext(stage, microbatch, phase))
    try:
        yield
    finally:
        _current.pop()


def _has_presplit_step(schedule_cls: type) -> bool:
    return "arg_mbs" in inspect.signature(schedule_cls.step).parameters


class MicrobatchAwareSchedule:
    """Mixin over a torch pipeline schedule; see the module docstring."""

    def _stages_list(self) -> list:
        return list(self._stages) if isinstance(self, PipelineScheduleMulti) else [self._stage]

    def _wrap_stages(self) -> None:
        for stage in self._stages_list():
            stage.forward_one_chunk = self._wrapped(stage, stage.forward_one_chunk, "forward")
            stage.backward_one_chunk = self._wrapped(stage, stage.backward_one_chunk, "backward")

    def _wrapped(self, stage, fn, phase: str):
        def run(chunk_id: int, *args, **kwargs):
            with microbatch_context(stage.stage_index, chunk_id, phase):
                return fn(chunk_id, *args, **kwargs)

        return run

    def _initialize_stage(self, *args, **kwargs):
        with measurement_paused():  # metadata inference runs a forward: not a micro-batch
            return super()._initialize_stage(*args, **kwargs)

    def _initialize_stages(self, *args, **kwargs):
        with measurement_paused():
            return super()._initialize_stages(*args, **kwargs)

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
        if _has_presplit_step(_base_schedule(type(self))):
            return super().step(
                arg_mbs=arg_mbs,
                kwarg_mbs=kwarg_mbs,
                target_mbs=target_mbs,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
            )
        # Backport of the pre-split step() for torch < 2.14.
        stages = self._stages_list()
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        for stage in stages:
            if stage.is_last and return_outputs:
                return self._merge_outputs(stage.output_chunks)
        return None


def _base_schedule(cls: type) -> type:
    return next(c for c in cls.__mro__ if c.__module__.startswith("torch.distributed.pipelining"))


class SB1F1B(MicrobatchAwareSchedule, Schedule1F1B):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._wrap_stages()


class SBGPipe(MicrobatchAwareSchedule, ScheduleGPipe):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._wrap_stages()


class SBInterleaved1F1B(MicrobatchAwareSchedule, ScheduleInterleaved1F1B):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._wrap_stages()


class SBZBVZeroBubble(MicrobatchAwareSchedule, ScheduleZBVZeroBubble):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._wrap_stages()


SCHEDULES: dict[str, type] = {
    "1f1b": SB1F1B,
    "gpipe": SBGPipe,
    "interleaved1f1b": SBInterleaved1F1B,
    "zbvzerobubble": SBZBVZeroBubble,
}


def rebuild_schedule(stock: _PipelineSchedule, name: str) -> _PipelineSchedule:
    """The recipe's subclass of `stock`, over the same stages and settings."""
    key = name.lower()
    if key not in SCHEDULES:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule: {name!r} is not supported by sb_titan; "
            f"expected one of {sorted(SCHEDULES)} (case-insensitive)"
        )
    cls = SCHEDULES[key]
    common = dict(
        n_microbatches=stock._n_microbatches,
        loss_fn=stock._loss_fn,
        scale_grads=stock.scale_grads,
    )
    if isinstance(stock, PipelineScheduleMulti):
        return cls(list(stock._stages), **common)
    return cls(stock._stage, **common)
