"""Rate limits for messages that recur every step (a drifting cost model, dropped
samples): said on the 1st, 2nd, 4th, 8th, ... occurrence, with the count, so a long run
keeps the warning visible without burying the step lines under it."""

from __future__ import annotations

import logging


def is_shown(count: int) -> bool:
    """Whether the `count`-th occurrence (from 1) is one to say: a power of two."""
    return count >= 1 and count & (count - 1) == 0


class Repeats:
    """Counts occurrences per key (a kind of message, not its text: the text may carry
    a value that changes every time)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def warning(self, log: logging.Logger, key: str, message: str) -> bool:
        """Log `message` if this occurrence of `key` is due; returns whether it was."""
        count = self.counts[key] = self.counts.get(key, 0) + 1
        if not is_shown(count):
            return False
        log.warning(
            "%s [%d time%s so far; shown at 1, 2, 4, 8, ...]",
            message,
            count,
            "" if count == 1 else "s",
        )
        return True
