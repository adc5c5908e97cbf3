"""Rate-limited reporting of refused connections and joins.

Every refusal (wrong token, wrong run id, malformed frames, duplicate node, world-size
disagreement, late join) is worth one log line with the peer's address and the reason,
but a misconfigured node retrying in a loop, or a hostile one, must not flood the log:
each (address, reason code) is logged at most once per window, and the next line says
how many were not shown.
"""

from __future__ import annotations

from collections import OrderedDict

_MAX_KEYS = 1024  # distinct (address, code) pairs remembered; the oldest is forgotten


class RefusalLog:
    """Decides which refusals to log (pure; the caller supplies the clock)."""

    def __init__(self, window: float = 10.0):
        self._window = window
        self._seen: OrderedDict[tuple[str, str], list[float]] = OrderedDict()

    def admit(self, peer: str, code: str, now: float) -> tuple[bool, int]:
        """Whether to log this refusal, and how many like it were held back before it."""
        key = (peer, code)
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self._window:
            entry[1] += 1
            return False, 0
        suppressed = int(entry[1]) if entry is not None else 0
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        while len(self._seen) > _MAX_KEYS:
            self._seen.popitem(last=False)
        return True, suppressed

    def line(self, peer: str, code: str, message: str, now: float) -> str | None:
        """The log line for a refusal, or None when it is held back."""
        shown, suppressed = self.admit(peer, code, now)
        if not shown:
            return None
        more = f" ({suppressed} more like it in the last {self._window:g} s)" if suppressed else ""
        return f"refused {peer or 'a client'} ({code}): {message}{more}"
