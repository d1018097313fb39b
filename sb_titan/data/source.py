"""What the loader needs from a dataset: metadata for planning, tokens for packing."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TokenSource(Protocol):
    """A dataset of tokenized samples addressed by stable integer ids (0..n-1)."""

    name: str

    @property
    def lengths(self) -> np.ndarray:
        """Token count of every sample, indexed by sample id (metadata only)."""
        ...

    def read(self, sample_id: int, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of one sample, int64."""
        ...
