"""Progress over a byte count, for the data tools (sb-prep and its --verify)."""

from __future__ import annotations

import sys


class Progress:
    """tqdm over input bytes when available, else a plain stderr line now and then."""

    def __init__(self, total: int, enabled: bool, desc: str = "sb-prep") -> None:
        self.total, self.done, self._shown = total, 0, -1
        self.enabled, self._desc = enabled, desc
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc)
            except ImportError:
                pass

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            pct = int(100 * self.done / max(self.total, 1))
            if pct // 5 != self._shown:
                self._shown = pct // 5
                print(f"{self._desc}: {pct}% of {self.total} bytes", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
