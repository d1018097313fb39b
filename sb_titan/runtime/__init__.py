"""The training runtime: the trainer, its pipeline schedules, the block clock and the
per-run context they share (docs/training.md)."""
