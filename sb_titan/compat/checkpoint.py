"""TorchTitan's DCP checkpoint manager, and its private save / load / purge steps as
hooks a subclass can override by public names.

Its home: `torchtitan.components.checkpointer` (TorchTitan 0.3.0 and its main branch).
0.3.0 also re-exports it as `torchtitan.components.checkpoint`, a shim main removed
(pytorch/torchtitan#4184), so nothing here imports the shim.

`save()` / `load()` / `maybe_wait_for_saving()` are the manager's public face, but they
call `_save`, `_load`, `_wait_for_saving` and `_purge_stale_checkpoints`, and those are
what a manager that adds a step to saving (a checksum manifest, runtime/checkpoint.py)
must replace; main keeps the same names and signatures.
"""

from __future__ import annotations

from torchtitan.components.checkpointer import CheckpointManager

__all__ = ["CheckpointHooks", "CheckpointManager"]


class CheckpointHooks(CheckpointManager):
    """CheckpointManager whose private steps call public hooks. A subclass overrides
    `save_checkpoint`, `load_checkpoint`, `saving_finished`, `purge_stale` and calls
    TorchTitan's own steps through `stock_save`, `stock_load`, `should_save`,
    `should_purge`, `checkpoint_dir`."""

    # -- hooks: by default, TorchTitan's behaviour -------------------------------------------
    def save_checkpoint(self, curr_step: int, last_step: bool) -> bool:
        """What `save()` does once checkpointing is on; True if a save started."""
        return self.stock_save(curr_step, last_step)

    def load_checkpoint(self, step: int) -> bool:
        """What `load()` does once checkpointing is on; True if something was loaded."""
        return self.stock_load(step)

    def saving_finished(self) -> None:
        """Called after an asynchronous save has finished, on every rank."""

    def purge_stale(self) -> None:
        """Queue the checkpoints `keep_latest_k` no longer keeps for deletion."""
        CheckpointManager._purge_stale_checkpoints(self)

    # -- TorchTitan's own steps ---------------------------------------------------------------
    def stock_save(self, curr_step: int, last_step: bool) -> bool:
        """TorchTitan's save: states → DCP (it calls the purge hook itself)."""
        return CheckpointManager._save(self, curr_step, last_step)

    def stock_load(self, step: int) -> bool:
        """TorchTitan's load of `step` (-1: the newest `step-N` folder)."""
        return CheckpointManager._load(self, step)

    def should_save(self, curr_step: int, last_step: bool) -> bool:
        """TorchTitan's interval rule (enable, interval, first and last step)."""
        return self._should_save(curr_step, last_step)

    def should_purge(self) -> bool:
        """Whether `keep_latest_k` asks for a purge at all."""
        return self._should_purge()

    def checkpoint_dir(self, step: int) -> str:
        """The folder TorchTitan saves `step` into (`<folder>/step-<step>`)."""
        return self._create_checkpoint_id(step)

    # -- the private names TorchTitan calls ---------------------------------------------------
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        return self.save_checkpoint(curr_step, last_step)

    def _load(self, step: int = -1) -> bool:
        return self.load_checkpoint(step)

    def _wait_for_saving(self) -> None:
        super()._wait_for_saving()
        self.saving_finished()

    def _purge_stale_checkpoints(self) -> None:
        self.purge_stale()
