"""Which rank holds the others up (pure).

Every member of a collective ends it at about the same moment (the data of the last
arrival completes it for everyone), so the time each member spent in it, from its own
start to its end, differs by how long it waited: the rank that spent the least arrived
last, and the others' time beyond its own is how late it was. That needs no aligned
clocks, only the durations each rank measures itself and sends with its heartbeats
(:class:`~shardwire.protocol.messages.Heartbeat` ``timings``).

Collectives are matched by (group id, sequence) once every member has reported; the
last WINDOW matched ones are kept, and a rank is named when it was last into a share of
them well above chance (halfway from 1 / group size to all of them) and late by at least
LATE_S on average, over at least MIN_SAMPLE of them. The sample bounds false alarms:
where every member is equally likely to be last, a given member of a pair is last into
at least 24 of 32 with probability 0.35 % (binomial), so either of the two is named by
chance in 0.7 % of verdicts; in groups of 3 or more, 0.014 % or less (fewer samples
than 32 would be: 7.7 % at 16, 29 % at 8, for pairs).
Memory is bounded: at most OPEN collectives wait for their members (the oldest are
dropped), and a window of WINDOW.
"""

from __future__ import annotations

import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

WINDOW = 1000  # matched collectives kept
OPEN = 4096  # collectives waiting for the rest of their members
LATE_S = 0.001  # below this, nobody is late: ranks arrive together within noise
MIN_SAMPLE = 32  # matched collectives of a rank before it may be named (see above)


@dataclass(frozen=True)
class Lateness:
    """One rank's record over the window."""

    rank: int
    last: int  # collectives it was last into
    share: float  # of the matched collectives it took part in
    chance: float  # the share it would have if every member were as likely to be last
    late_s: float  # mean, over those it was last into, of how late it was
    taken: int  # matched collectives of the window it took part in


class Stragglers:
    """Matches ranks' collective timings and says who arrives last."""

    def __init__(self, window: int = WINDOW, open_limit: int = OPEN) -> None:
        self._open: OrderedDict[tuple[int, int], tuple[int, dict[int, int]]] = OrderedDict()
        self._open_limit = open_limit
        self._window: deque[tuple[int, float, tuple[int, ...]]] = deque(maxlen=window)

    def add(self, rank: int, timings: Iterable[tuple[int, int, int, int]]) -> None:
        """``rank``'s (group, size, seq, microseconds) of collectives it ended."""
        for group, size, seq, micros in timings:
            if size < 2:
                continue
            key = (group, seq)
            _, spent = self._open.get(key) or self._open.setdefault(key, (size, {}))
            spent[rank] = micros
            if len(spent) >= size:
                del self._open[key]
                self._match(spent)
        while len(self._open) > self._open_limit:
            self._open.popitem(last=False)

    def _match(self, spent: dict[int, int]) -> None:
        last = min(spent, key=lambda r: (spent[r], r))
        others = [us for r, us in spent.items() if r != last]
        late = (statistics.median(others) - spent[last]) / 1e6
        self._window.append((last, late, tuple(spent)))

    def ranks(self) -> list[Lateness]:
        """Every rank that was last into some collective of the window, most often first."""
        taken: Counter[int] = Counter()
        odds: dict[int, float] = {}
        lasts: Counter[int] = Counter()
        late: dict[int, float] = {}
        for last, seconds, members in self._window:
            taken.update(members)
            for member in members:
                odds[member] = odds.get(member, 0.0) + 1 / len(members)
            lasts[last] += 1
            late[last] = late.get(last, 0.0) + seconds
        rows = [
            Lateness(
                rank, n, n / taken[rank], odds[rank] / taken[rank], late[rank] / n, taken[rank]
            )
            for rank, n in lasts.items()
        ]
        return sorted(rows, key=lambda row: (-row.share, -row.late_s, row.rank))

    def straggler(self) -> Lateness | None:
        """The rank that holds the others up, if one does (see the module docstring)."""
        rows = self.ranks()
        if not rows:
            return None
        top = rows[0]
        well_above = top.share >= (top.chance + 1) / 2
        enough = top.taken >= MIN_SAMPLE
        return top if enough and well_above and top.late_s >= LATE_S else None

    def matched(self) -> int:
        """Collectives in the window."""
        return len(self._window)

    def waiting(self) -> int:
        """Collectives some member has not reported yet."""
        return len(self._open)


def describe(row: Lateness, host: str, matched: int) -> str:
    """The line the status views show."""
    return (
        f"rank {row.rank} ({host}) was last into {row.share:.0%} of its collectives "
        f"(of the last {matched}), {row.late_s * 1e3:.0f} ms late on average"
    )
