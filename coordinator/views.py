"""The job as monitoring clients see it (pure)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from shardwire.coordinator import linktable
from shardwire.coordinator.state import JobState
from shardwire.coordinator.stragglers import describe
from shardwire.protocol.messages import RankStatus, StatusReply

if TYPE_CHECKING:
    from shardwire.coordinator.rendezvous import Rendezvous


def status_reply(
    rdzv: Rendezvous, now: float, offset: int = 0, limit: int | None = None
) -> StatusReply:
    """State, ranks of the current generation (rows ``offset`` onwards, at most ``limit``;
    None: all), restarts and every generation so far."""
    # the last failure, while it is the job's end or the cause of the restart under way
    ended = rdzv.state in (JobState.FAILED, JobState.RESTARTING, JobState.FAILING)
    failure = rdzv.failure if ended else None
    shape = rdzv.shape
    page, total = rdzv.rows(offset, limit)
    return StatusReply(
        run_id=rdzv.config.run_id,
        state=rdzv.state.value,
        world_size=shape.world_size if shape else (rdzv.config.world_size or 0),
        generation=rdzv.generation,
        failure=f"rank {failure.rank}: {failure.reason}"[:4096] if failure else "",
        ranks=[
            RankStatus(
                **w.progress.model_dump(exclude={"kind", "timings", "links"}),
                rank=w.rank,
                node_id=w.join.node_id,
                host=w.host,
                state=w.state.value,
                heartbeat_age_s=round(max(0.0, now - w.last_seen), 3),
            )
            for w in page
        ],
        total=total,
        offset=offset,
        restarts=rdzv.gens.restarts,
        max_restarts=rdzv.gens.max_restarts,
        generations=rdzv.gens.info(now),
        straggler=_straggler(rdzv),
        slow_link=_slow_link(rdzv, now),
    )


def rank_summary(rdzv: Rendezvous) -> tuple[Counter[str], tuple[int, int]]:
    """The current generation's ranks by state, and the lowest and highest step any
    reported (0, 0 for none), read straight from the workers: no row is built."""
    workers = rdzv.workers
    steps = [w.progress.step for w in workers]
    return Counter(w.state.value for w in workers), (min(steps, default=0), max(steps, default=0))


def _straggler(rdzv: Rendezvous) -> str:
    row = rdzv.stragglers.straggler()
    if row is None:
        return ""
    return describe(row, host_of(rdzv, row.rank), rdzv.stragglers.matched())


def _slow_link(rdzv: Rendezvous, now: float) -> str:
    slow = rdzv.links.slow(now)
    return "" if slow is None else linktable.describe(slow, lambda rank: host_of(rdzv, rank))


def host_of(rdzv: Rendezvous, rank: int) -> str:
    """The host of a rank of the running generation ("?" if it is not known)."""
    worker = rdzv.worker_of(rank)
    return "?" if worker is None else worker.host


API_LINKS = 4096  # directed links per /api/links response, most bytes first


def links_json(rdzv: Rendezvous, limit: int = API_LINKS, now: float | None = None) -> dict:
    """The job's peer links for machines and the page's heat map: the busiest ``limit``
    directed links (of ``total``), the world size, and the slow link if one is."""
    table = rdzv.links
    found = table.links(now)
    slow = table.slow(now)
    shape = rdzv.shape
    return {
        "world_size": shape.world_size if shape else 0,
        "total": len(found),
        "links": [
            {
                "src": k.src,
                "dst": k.dst,
                "path": k.path,
                "bytes": k.bytes,
                "messages": k.messages,
                "bandwidth": k.bandwidth,
                "rtt_s": k.rtt_s,
            }
            for k in found[: max(0, min(limit, API_LINKS))]
        ],
        "slow": None
        if slow is None
        else {
            "src": slow.link.src,
            "dst": slow.link.dst,
            "path": slow.link.path,
            "what": slow.what,
            "value": slow.value,
            "median": slow.median,
            "text": linktable.describe(slow, lambda rank: host_of(rdzv, rank)),
        },
    }
