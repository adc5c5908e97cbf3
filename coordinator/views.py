"""The job as monitoring clients see it (pure)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwire.coordinator.state import JobState, Worker
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
    workers = sorted(rdzv.workers, key=lambda w: (w.rank, w.join.node_id))
    page = workers[offset:] if limit is None else workers[offset : offset + limit]
    return StatusReply(
        run_id=rdzv.config.run_id,
        state=rdzv.state.value,
        world_size=shape.world_size if shape else (rdzv.config.world_size or 0),
        generation=rdzv.generation,
        failure=f"rank {failure.rank}: {failure.reason}"[:4096] if failure else "",
        ranks=[
            RankStatus(
                **w.progress.model_dump(exclude={"kind", "timings"}),
                rank=w.rank,
                node_id=w.join.node_id,
                host=w.host,
                state=w.state.value,
                heartbeat_age_s=round(max(0.0, now - w.last_seen), 3),
            )
            for w in page
        ],
        total=len(workers),
        offset=offset,
        restarts=rdzv.gens.restarts,
        max_restarts=rdzv.gens.max_restarts,
        generations=rdzv.gens.info(now),
        straggler=_straggler(rdzv, workers),
    )


def _straggler(rdzv: Rendezvous, workers: list[Worker]) -> str:
    row = rdzv.stragglers.straggler()
    if row is None:
        return ""
    host = next((w.host for w in workers if w.rank == row.rank), "?")
    return describe(row, host, rdzv.stragglers.matched())
