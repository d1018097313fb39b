"""TorchTitan model internals the recipe relies on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn


@contextlib.contextmanager
def hidden_states_only(model: nn.Module) -> Iterator[None]:
    """While inside, TorchTitan's decoder returns the final hidden states instead of
    logits (its private `_skip_lm_head`, an attribute rather than a forward argument
    because pipeline backward calls forward without keywords). Generation runs the head
    on the last position only instead of materialising [B, L, vocab]."""
    skip = model._skip_lm_head
    model._skip_lm_head = True
    try:
        yield
    finally:
        model._skip_lm_head = skip
