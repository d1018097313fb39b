"""What the trainer, its pipeline schedule and its block clock share during a run:
which micro-batch is being computed, and whether a forward counts as training compute.

One object per trainer, handed to the schedule and the clock, so two trainers in one
process (or a test) never see each other's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MicrobatchContext:
    stage: int  # pipeline stage index (global), 0 without PP
    microbatch: int  # index within the step on this rank
    phase: str  # "forward" | "backward" | "forward_backward"


class RunContext:
    def __init__(self) -> None:
        self._stack: list[MicrobatchContext] = []
        self._paused = 0

    def current(self) -> MicrobatchContext | None:
        """The (stage, micro-batch, phase) being computed right now, if any."""
        return self._stack[-1] if self._stack else None

    @contextlib.contextmanager
    def microbatch(self, stage: int, microbatch: int, phase: str) -> Iterator[None]:
        self._stack.append(MicrobatchContext(stage, microbatch, phase))
        try:
            yield
        finally:
            self._stack.pop()

    @property
    def measuring(self) -> bool:
        return self._paused == 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards that are not training compute (the pipeline's shape inference) are
        neither timed nor recorded."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
