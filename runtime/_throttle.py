"""Rate-limited warning lines: the first few events, then at most one line per interval that
says how many went unlogged since (the control channel's dropped messages, the gate's refused
connections)."""

from __future__ import annotations


class Throttle:
    def __init__(self, first: int, every_s: float) -> None:
        self.first, self.every_s = first, every_s
        self._at, self._count = 0.0, 0

    def due(self, count: int, now: float) -> int | None:
        """For the ``count``-th event at ``now``: None to stay quiet, else how many events
        since the last line were not logged (the caller logs one line now)."""
        if count > self.first and now - self._at < self.every_s:
            return None
        more = count - self._count - 1
        self._at, self._count = now, count
        return max(0, more)
