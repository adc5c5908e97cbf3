"""Pipeline schedules (pure): the order in which each rank runs its forward and backward
passes, and a simulated timeline to see the bubble.

A pipeline of ``p`` ranks runs ``p * v`` stages: rank r holds ``v`` chunks of the model,
chunk c being stage ``c * p + r`` (``v = 1``: one contiguous stage per rank). An
operation is ``(kind, chunk, micro)`` with kind "F" or "B".

* gpipe (v = 1): every forward, then every backward.
* 1f1b (v = 1): ``p - r - 1`` forwards ahead, then one forward and one backward in turn,
  then the remaining backwards; at most ``p - r`` micro-batches in flight on rank r.
  Bubble: (p - 1) / (m + p - 1) of a step.
* interleaved (v >= 2, micro-batches a multiple of p; Narayanan et al., 2021, as in
  Megatron-LM): forwards go through the chunks in rounds of p micro-batches, backwards
  through the chunks in reverse; rank r runs ``2 (p - r - 1) + (v - 1) p`` forwards
  ahead. A rank idles for p - 1 chunk passes instead of p - 1 stage passes, so the
  bubble is (p - 1) / (v m + p - 1), at the price of v times the messages.

:func:`timeline` plays a schedule out with every rank waiting for what its next
operation needs (the previous stage's forward, the next stage's backward), forwards
taking one time unit and backwards two; :func:`picture` draws it.
"""

from __future__ import annotations

from typing import NamedTuple

from shardwire.protocol.errors import InvalidArgument, InvalidState

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Op(NamedTuple):
    kind: str  # "F" or "B"
    chunk: int
    micro: int


def check(schedule: str, stages: int, micro_batches: int, chunks: int) -> None:
    """Raise ValueError for a schedule these sizes cannot run."""
    if schedule not in SCHEDULES:
        raise InvalidArgument(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if stages < 1 or micro_batches < 1 or chunks < 1:
        raise InvalidArgument("stages, micro-batches and chunks must be at least 1")
    if schedule == "interleaved":
        if chunks < 2:
            raise InvalidArgument("the interleaved schedule needs at least 2 chunks per rank")
        if micro_batches % stages:
            raise InvalidArgument(
                f"the interleaved schedule needs micro-batches in multiples of the "
                f"{stages} stages, got {micro_batches}"
            )
    elif chunks != 1:
        raise InvalidArgument(f"{chunks} chunks per rank need the interleaved schedule")


def order(schedule: str, stages: int, rank: int, micro_batches: int, chunks: int = 1) -> list[Op]:
    """Rank ``rank``'s operations of one step, in the order it runs them."""
    check(schedule, stages, micro_batches, chunks)
    p, m, v = stages, micro_batches, chunks
    if schedule == "gpipe":
        return [Op("F", 0, i) for i in range(m)] + [Op("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(p - rank - 1, m)
        ops = [Op("F", 0, i) for i in range(warm)]
        for i in range(warm, m):
            ops += [Op("F", 0, i), Op("B", 0, i - warm)]
        return ops + [Op("B", 0, i) for i in range(m - warm, m)]
    total = m * v

    def nth(k: int, backward: bool) -> Op:
        chunk = (k // p) % v
        micro = (k // (p * v)) * p + k % p
        return Op("B", v - 1 - chunk, micro) if backward else Op("F", chunk, micro)

    warm = min(2 * (p - rank - 1) + (v - 1) * p, total)
    ops = [nth(k, False) for k in range(warm)]
    for k in range(total - warm):
        ops += [nth(k + warm, False), nth(k, True)]
    return ops + [nth(k, True) for k in range(total - warm, total)]


class Slot(NamedTuple):
    op: Op
    start: float
    end: float


def timeline(
    schedule: str,
    stages: int,
    micro_batches: int,
    chunks: int = 1,
    *,
    forward: float = 1.0,
    backward: float = 2.0,
) -> list[list[Slot]]:
    """Every rank's operations with their start and end times, each rank running its
    :func:`order` and waiting for what the next operation needs."""
    p, v = stages, chunks
    orders = [order(schedule, p, r, micro_batches, v) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro) -> end time
    free, nxt = [0.0] * p, [0] * p
    slots: list[list[Slot]] = [[] for _ in range(p)]
    last_stage = p * v - 1
    for _ in range(sum(len(o) for o in orders)):
        for r in range(p):
            if nxt[r] == len(orders[r]):
                continue
            op = orders[r][nxt[r]]
            stage = op.chunk * p + r
            if op.kind == "F":
                needs = [("F", stage - 1, op.micro)] if stage else []
            else:
                needs = [("F", stage, op.micro)]
                needs += [("B", stage + 1, op.micro)] if stage < last_stage else []
            if any(n not in done for n in needs):
                continue
            start = max([free[r], *(done[n] for n in needs)])
            end = start + (forward if op.kind == "F" else backward)
            done[(op.kind, stage, op.micro)] = free[r] = end
            slots[r].append(Slot(op, start, end))
            nxt[r] += 1
            break
        else:
            if all(nxt[r] == len(orders[r]) for r in range(p)):
                break
            raise InvalidState(f"the {schedule} schedule deadlocks at {nxt}")
    return slots


def bubble(slots: list[list[Slot]]) -> float:
    """The share of the ranks' time spent idle, from the first start to the last end."""
    span = max(s.end for rank in slots for s in rank)
    busy = sum(s.end - s.start for rank in slots for s in rank)
    return 1.0 - busy / (span * len(slots))


def picture(slots: list[list[Slot]]) -> str:
    """One line per rank, one character per time unit: a forward of micro-batch i is
    the lowercase letter i (a = 0), a backward the uppercase one, an idle unit a dot."""
    span = int(max(s.end for rank in slots for s in rank))
    lines = []
    for r, rank in enumerate(slots):
        row = ["."] * span
        for op, start, end in rank:
            letter = chr(ord("a") + op.micro % 26)
            for t in range(int(start), int(end)):
                row[t] = letter if op.kind == "F" else letter.upper()
        lines.append(f"rank {r}  {''.join(row)}")
    return "\n".join(lines)
