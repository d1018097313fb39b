"""Autograd internals the recipe needs and torch has no public API for."""

from __future__ import annotations

import torch


def in_backward_recompute() -> bool:
    """True while autograd runs a backward pass (e.g. activation checkpointing
    re-running a forward), read from the engine's current graph task."""
    return torch._C._current_graph_task_id() != -1
