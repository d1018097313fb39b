"""What the loader needs from a dataset: metadata for planning, tokens for packing."""

from __future__ import annotations

import hashlib
from pathlib import Path
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


def integrity_note(source: TokenSource) -> str | None:
    """A line saying a dataset's tokens are read unverified (written before sb-prep
    recorded checksums); None for a verified dataset or a generated corpus."""
    note = getattr(source, "integrity_note", None)
    return note() if note is not None else None


class TokenizerMismatch(ValueError):
    """A dataset prepared with another tokenizer than the model's."""


def tokenizer_file_sha256(tokenizer_dir: str | Path) -> str | None:
    """sha256 of `tokenizer_dir`/tokenizer.json, the file TorchTitan loads the model's
    tokenizer from (and sb-prep records); None when there is no such file."""
    file = Path(tokenizer_dir) / "tokenizer.json"
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None


def check_tokenizer(source: TokenSource, tokenizer_dir: str | Path) -> str | None:
    """The dataset's tokens must come from the model's tokenizer (config.hf_assets_path):
    ids of another tokenizer that happen to fit the vocabulary train silently on noise.
    Raises TokenizerMismatch; returns a note when the two cannot be compared."""
    recorded = getattr(source, "tokenizer_sha256", None)
    if recorded is None:  # a generated corpus: no tokenizer recorded
        return None
    where = getattr(source, "meta_file", source.name)
    expected = recorded()
    actual = tokenizer_file_sha256(tokenizer_dir)
    if expected is None:
        return (
            f"{where}: no tokenizer.sha256 (prepared by an older sb-prep); the dataset's "
            f"tokenizer is not checked against hf_assets_path = {str(tokenizer_dir)!r}"
        )
    if actual is None:
        return (
            f"hf_assets_path = {str(tokenizer_dir)!r} has no tokenizer.json; the dataset's "
            f"tokenizer ({where}) is not checked against it"
        )
    if actual != expected:
        raise TokenizerMismatch(
            f"{where}: tokenizer.sha256 = {expected[:12]}... but the model's tokenizer "
            f"(hf_assets_path = {str(tokenizer_dir)!r}) is {actual[:12]}...; prepared with "
            f"another tokenizer? (sb-prep --tokenizer {tokenizer_dir}, or point "
            "hf_assets_path at the tokenizer it was prepared with)"
        )
    return None
