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

    def max_token_id(self) -> int:
        """The largest token id any sample can hold (from metadata where there is some),
        checked against the model's vocabulary before any rank spawns."""
        ...


class VocabularyError(ValueError):
    """Token ids the model's embedding cannot look up."""


def check_vocabulary(source: TokenSource, vocab_size: int, flavor: str) -> None:
    """Every token id of `source` (a TokenSource) must be below the model's vocabulary;
    a dataset tokenized with another tokenizer otherwise dies inside the embedding."""
    top = source.max_token_id()
    if top >= vocab_size:
        raise VocabularyError(
            f"{source.name}: token id {top} does not fit the model's vocabulary of "
            f"{vocab_size} (model.flavor = {flavor!r}); was it tokenized with another "
            "tokenizer? (sb-prep --tokenizer, and the config's hf_assets_path)"
        )
