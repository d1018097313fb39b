"""Densities observed per sample, visible to the planner only from the step they
take effect, so prefetch timing can never make ranks plan differently. The same store
keeps each sample's last measured recall (`columns=3`: budget, kept mass, weight) for
per-document budgets ([dst] doc_history)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

REWIND_STEPS = 256  # how far back a restored state may re-plan with exact observations


@dataclass(slots=True)
class _Observed:
    """One `observe` call: densities of `ids`, visible from planner step `at_step`."""

    at_step: int
    ids: np.ndarray  # int64, unique
    values: np.ndarray  # float32
    previous: np.ndarray | None = None  # what they overwrote; None while not yet applied


class DensityStore:
    """Observed densities by sample id, made visible at a fixed planner step.

    The trainer reports densities some steps after the loader planned ahead, at a time
    that differs between ranks; tying each observation to the step it takes effect
    (`at_step`) keeps every rank's plans identical. Applied entries keep the values they
    overwrote for REWIND_STEPS steps, so a restored, older planner state re-plans exactly.
    """

    def __init__(self, num_samples: int, columns: int = 1) -> None:
        self.num_samples = num_samples
        self.columns = columns  # values per sample (1: a vector of densities)
        self.values: np.ndarray | None = None  # float32, NaN = never observed
        self.log: list[_Observed] = []
        self.applied_through = -1  # entries with at_step <= this are in `values`
        self.pruned_through = -1  # entries up to here were forgotten (no rewind before)

    def add(self, at_step: int, ids: np.ndarray, values: np.ndarray) -> None:
        if at_step <= self.applied_through:
            raise RuntimeError(
                f"sab: densities for step {at_step} arrived after that step was planned "
                f"(planned through {self.applied_through}); raise sab.observe_lag"
            )
        if self.log and at_step < self.log[-1].at_step:
            raise ValueError(
                f"sab: observations must come in step order ({at_step} after "
                f"{self.log[-1].at_step})"
            )
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise ValueError(f"sab: observed sample id out of range [0, {self.num_samples})")
        if values.shape[1:] != self._shape[1:] or len(values) != len(ids):
            raise ValueError(
                f"sab: need {self._shape[1:] or 'one'} value(s) per id, got {values.shape} "
                f"for {len(ids)} ids"
            )
        if not np.all((values > 0) & (values <= 1)):
            raise ValueError("sab: observed densities must lie in (0, 1]")
        ids, last = np.unique(ids[::-1], return_index=True)  # a repeated id: last one wins
        self.log.append(_Observed(at_step, ids, values[::-1][last].astype(np.float32)))

    def visible_at(self, step: int) -> None:
        """Show exactly the entries with at_step <= step (hide later ones a restored,
        older planner state must not see yet; apply earlier ones not applied yet)."""
        self._rewind(step)
        for e in self.log:
            if e.previous is None and e.at_step <= step:
                if self.values is None:
                    self.values = np.full(self._shape, np.nan, dtype=np.float32)
                e.previous = self.values[e.ids]
                self.values[e.ids] = e.values
        self.applied_through = max(self.applied_through, step)
        while self.log and self.log[0].previous is not None:
            if self.log[0].at_step >= step - REWIND_STEPS:
                break
            self.pruned_through = self.log.pop(0).at_step

    def _rewind(self, step: int) -> None:
        if step < self.pruned_through:
            raise ValueError(
                f"sab: cannot restore planner step {step + 1}: observations up to step "
                f"{self.pruned_through} were already folded in"
            )
        for e in reversed(self.log):
            if e.previous is not None and e.at_step > step:
                self.values[e.ids] = e.previous
                e.previous = None
        self.applied_through = min(self.applied_through, step)

    def lookup(self, ids: Sequence[int]) -> np.ndarray:
        """Visible observed densities of `ids` (NaN where never observed)."""
        if self.values is None:
            return np.full((len(ids), *self._shape[1:]), np.nan, dtype=np.float32)
        return self.values[np.asarray(ids, dtype=np.int64)]

    @property
    def _shape(self) -> tuple[int, ...]:
        return (self.num_samples,) if self.columns == 1 else (self.num_samples, self.columns)

    def state_dict(self) -> dict:
        return {
            "values": None if self.values is None else self.values.copy(),
            "log": [
                {"at_step": e.at_step, "ids": e.ids, "values": e.values, "previous": e.previous}
                for e in self.log  # entry arrays are never modified in place: no copies
            ],
            "applied_through": self.applied_through,
            "pruned_through": self.pruned_through,
        }

    def load_state_dict(self, state: dict) -> None:
        values = state["values"]
        if values is not None and len(values) != self.num_samples:
            raise ValueError(
                f"sab: checkpointed densities cover {len(values)} samples, the dataset has "
                f"{self.num_samples}"
            )
        self.values = None if values is None else np.array(values, dtype=np.float32)
        self.log = [_Observed(**e) for e in state["log"]]
        self.applied_through = state["applied_through"]
        self.pruned_through = state["pruned_through"]
