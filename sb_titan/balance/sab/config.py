"""The `[sab]` section: packing policy and how long documents are handled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# Literal types, so the CLI help and the TOML errors list the choices.
Policy = Literal["sab", "tokens", "sequential"]
POLICIES: tuple[str, ...] = get_args(Policy)
LongDocMode = Literal["split", "truncate", "drop"]
LONG_DOC_MODES: tuple[str, ...] = get_args(LongDocMode)


@dataclass(kw_only=True, slots=True)
class SABConfig:
    policy: Policy = "sab"
    """Packing policy: `sab` (price pieces by predicted latency at their density;
    needs a cost model), `tokens` (the same packer, cost = token count), `sequential`
    (rows filled in data order: the baseline)."""
    long_docs: LongDocMode = "split"
    """Documents longer than a row: `split` into row-sized chunks, `truncate`, or `drop`."""
    shuffle: bool = True
    """Visit samples in a seeded random order each epoch (else in id order)."""
    seed: int = 0
    max_tokens: int | None = None
    """Token cap per micro-batch; default (None) rows x seq_len, which is also the maximum."""
    observe_lag: int = 8
    """Observed densities from step s shape plans from step s + observe_lag on. Must exceed
    how far the loader plans ahead, so every rank applies them at the same step."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"sab.policy: unknown policy {self.policy!r}; expected one of {POLICIES}"
            )
        if self.long_docs not in LONG_DOC_MODES:
            raise ValueError(
                f"sab.long_docs: unknown mode {self.long_docs!r}; expected one of {LONG_DOC_MODES}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"sab.max_tokens: must be >= 1 (got {self.max_tokens})")
        if self.observe_lag < 1:
            raise ValueError(f"sab.observe_lag: must be >= 1 (got {self.observe_lag})")
