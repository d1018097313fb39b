"""TorchTitan's rule for which rank writes metrics, kept in a private function."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims


def metrics_rank(parallel_dims: ParallelDims, pp_schedule: str) -> int:
    """The rank TorchTitan's own TensorBoard logger writes on (rank 0, or the first rank
    of the last pipeline stage), so a recipe logger writes where TorchTitan's would."""
    from torchtitan.components.metrics import _get_metrics_rank

    return _get_metrics_rank(parallel_dims=parallel_dims, pp_schedule=pp_schedule)
