"""CostModel's keyword options, named so that every constructor forwarding them
(`CostModel.analytic`, `CostModel.from_file`, the profiler's `load_cost_model`) is
typed rather than taking `**kwargs: Any`."""

from __future__ import annotations

from typing import TypedDict

from sb_titan.balance.cost_model.density import DensityModel
from sb_titan.balance.cost_model.recall import RecallMeasure


class CostModelOptions(TypedDict, total=False):
    """Every key optional: each constructor keeps CostModel's defaults."""

    density_model: DensityModel | None
    refit_rate: float
    ape_rate: float
    ridge: float
    scale_bounds: tuple[float, float]
    recall_measure: RecallMeasure
    recall_beta_knots: int
