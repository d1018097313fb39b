"""Pipeline internals of torch and TorchTitan: the pre-split `step(arg_mbs=, kwarg_mbs=,
target_mbs=)` TorchTitan calls (missing before torch 2.14); a built schedule's settings,
which torch keeps in private attributes; the forward torch runs to infer stage shapes;
Interleaved1F1B's action order; TorchTitan's split of a model into stages."""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any

from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineSchedule

if TYPE_CHECKING:
    from torchtitan.config import ParallelismConfig
    from torchtitan.protocols.model import BaseModel


def torch_schedule_class(cls: type) -> type:
    """The torch schedule a recipe subclass derives from."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("torch.distributed.pipelining"))


def has_presplit_step(schedule_cls: type) -> bool:
    """Whether torch's schedule takes pre-split micro-batches itself (torch >= 2.14)."""
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


class ShapeInferenceHook:
    """Mixin over a torch schedule: torch infers stage shapes by running a forward in
    its private `_initialize_stage(s)`, the first time `step()` runs. A subclass's
    `shape_inference()` gives the context that forward runs in (e.g. "not a
    micro-batch")."""

    def shape_inference(self) -> contextlib.AbstractContextManager:
        """The context torch's shape-inference forward runs inside."""
        return contextlib.nullcontext()

    def _initialize_stage(self, *args, **kwargs):
        with self.shape_inference():
            return super()._initialize_stage(*args, **kwargs)

    def _initialize_stages(self, *args, **kwargs):
        with self.shape_inference():
            return super()._initialize_stages(*args, **kwargs)


def interleaved_1f1b_order(
    pp: int, virtual: int, microbatches: int, rounds: int
) -> list[list[tuple[str, int, int]]]:
    """Per pipeline rank, its ("F" | "B", stage, micro-batch) actions in the order
    torch's Interleaved1F1B runs them: torch's own `_calculate_single_rank_operations`,
    on a schedule built without stages or process groups (its __init__ needs both)."""
    sched = object.__new__(S.ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages = pp, virtual
    sched._n_microbatches, sched.number_of_rounds = microbatches, rounds
    sched.microbatches_per_round = microbatches // rounds
    kinds = {S._ComputationType.FORWARD: "F", S._ComputationType.FULL_BACKWARD: "B"}
    return [
        [
            (kinds[a.computation_type], a.stage_index, a.microbatch_index)
            for a in sched._calculate_single_rank_operations(r)
            if a is not None and a.computation_type in kinds
        ]
        for r in range(pp)
    ]


def llm_stage_modules(
    n_stages: int, n_layers: int, first_less: int, last_less: int
) -> list[list[str]]:
    """Module names per stage as TorchTitan splits a decoder (its private
    `_generate_llm_fqn_per_model_part`): the first and last stages take `*_less` fewer
    layers for the embedding and the output head."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    return _generate_llm_fqn_per_model_part(n_stages, n_layers, first_less, last_less)


def pipeline_metadata(
    pp: int, parallelism: ParallelismConfig, model_config: BaseModel.Config
) -> tuple[int, int, int, int]:
    """(stages, layers, input weight, output weight) as TorchTitan's `pipeline_llm`
    derives them from the [parallelism] section (its private `_get_pipeline_metadata`,
    which reads only the pipeline degree of the mesh); raises ValueError on a section
    it refuses."""
    from types import SimpleNamespace

    from torchtitan.distributed.pipeline_parallel import _get_pipeline_metadata

    return _get_pipeline_metadata(SimpleNamespace(pp=pp), parallelism, model_config)
