"""Units flattened to documents once, for batched prediction and inversion."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class UnitBatch:
    """Documents of several units, flattened once so each bisection step is vectorised
    (and, in DST, so one step's predictions, inversions and recall share one flattening)."""

    lengths: np.ndarray  # [D]
    unit: np.ndarray  # [D] unit index of each document
    rows: np.ndarray  # [D, J] attention seconds at each profiled density
    forced: np.ndarray  # [D] least possible density
    rest: np.ndarray  # [U] unscaled overhead + linear seconds
    density_rows: tuple | None = None  # DensityModel.length_rows, made on first use

    @property
    def n_units(self) -> int:
        return len(self.rest)

    def subset(self, idx: np.ndarray) -> UnitBatch:
        """The documents of units idx (in that order, renumbered 0..len(idx)-1), each
        unit's documents in their original order: per-unit sums are unchanged."""
        new_id = np.full(self.n_units, -1, dtype=np.int64)
        new_id[idx] = np.arange(len(idx))
        keep = np.flatnonzero(new_id[self.unit] >= 0)
        order = keep[np.argsort(new_id[self.unit[keep]], kind="stable")]
        dens = self.density_rows
        return UnitBatch(
            lengths=self.lengths[order],
            unit=new_id[self.unit[order]],
            rows=self.rows[order],
            forced=self.forced[order],
            rest=self.rest[idx],
            density_rows=None if dens is None else tuple(a[order] for a in dens),
        )
