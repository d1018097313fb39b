"""TorchTitan's data-loader base class, wherever this TorchTitan keeps it, and stopping a
torchdata Prefetcher's thread.

TorchTitan 0.3.0 has `torchtitan.components.dataloader.BaseDataLoader`. Its main branch
replaced that module with Grain-based loaders (pytorch/torchtitan#4088) and keeps the
base class, the same contract, in `torchtitan.components.data.loader`. A TorchTitan with
neither gets `_ProtocolBase`, the contract itself: `Stateful` (the trainer checkpoints
the loader under "dataloader"), `Configurable` (`Config.build(...)` makes the loader),
an abstract `__iter__` and `close()`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful
from torchdata.nodes import Prefetcher
from torchtitan.config import Configurable

__all__ = ["BaseDataLoader", "stop_prefetcher"]

HOMES = ("torchtitan.components.data.loader", "torchtitan.components.dataloader")
"""Where TorchTitan keeps BaseDataLoader: main (Grain) first, then 0.3.0."""


class _ProtocolBase(Stateful, ABC, Configurable):
    """TorchTitan's data-loader contract, for a TorchTitan that moved the class again."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    @abstractmethod
    def __iter__(self) -> Iterator[Any]: ...

    def close(self) -> None:
        """Release what the loader holds (threads, files)."""


def base_dataloader() -> type:
    """The first home in HOMES that imports, else the contract itself."""
    for home in HOMES:
        try:
            return importlib.import_module(home).BaseDataLoader
        except (ImportError, AttributeError):
            continue
    return _ProtocolBase


BaseDataLoader = base_dataloader()


def stop_prefetcher(node: Prefetcher) -> None:
    """Stop a started torchdata `Prefetcher`'s worker thread now. torchdata stops it
    only on reset or garbage collection (`_it._shutdown()`, private); a prefetch thread
    left running while the interpreter exits can abort the process."""
    worker = getattr(node, "_it", None)
    if worker is not None:
        worker._shutdown()
