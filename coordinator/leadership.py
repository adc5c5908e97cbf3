"""One leader among a job's coordinator replicas, under an etcd lease, and the journal it
alone may write there.

Theory of operation. Every replica of run R campaigns for the key
``/shardwire/R/leader``: one transaction puts it, bound to the replica's lease, only if
the key does not exist. The winner's **epoch** is that key's create revision: etcd's
revisions only grow, so each leadership of the run has a larger epoch than the last.
The others are standbys: they read who leads, look again every ``POLL`` seconds, and
campaign again once the key is gone (the leader's lease expired or was revoked). A
standby does not listen on its port: workers, which know every replica's address, find
the leader by dialing them in turn, and refuse a coordinator whose epoch is older than
one they already followed (the handshake's ``Welcome`` carries it).

The leader renews its lease every ``ttl / 4`` seconds. If no renewal succeeds within
``ttl`` of the last one sent, or one finds the lease gone, it is deposed: it stops
serving at once, since a standby may already lead. Every journal write is a transaction
that holds only while the leader key is still the one this replica created (create
revision == epoch), so a deposed leader's decision never reaches the journal, and the
coordinator does not send a decision it could not journal.

When the job ends, the leader writes its outcome to ``/shardwire/R/ended`` and revokes
its lease: the standbys read the outcome and end with it, rather than lead a job that is
over. (A replica started later for a new job of the same run id ignores an end written
before it was: it compares revisions.)

Keys: the leader key, ``/shardwire/R/journal`` (the coordinator's journal, zlib'd
JSON: written when a generation forms or ends, never for heartbeats) and the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from shardwire.coordinator.etcd import EtcdClient, EtcdRefused, EtcdUnavailable, b64, range_entry
from shardwire.coordinator.journal import Deposed, Journal, parse_journal

log = logging.getLogger("shardwire.coordinator")

POLL = 0.2  # seconds between a standby's looks at who leads (a read: cheap for etcd)


@dataclass(frozen=True, slots=True)
class Term:
    """This replica's leadership: its epoch (the leader key's create revision), lease."""

    epoch: int
    lease: int


class Leadership:
    """This replica's part in electing its run's leader (owned by ``serve``)."""

    def __init__(self, client: EtcdClient, run_id: str, me: str, *, ttl: int = 2) -> None:
        self.client = client
        self.me = me  # what the leader key says of this replica (its address, PID, host)
        self.ttl = ttl
        self.run_id = run_id
        self.key = f"/shardwire/{run_id}/leader"
        self.ended = f"/shardwire/{run_id}/ended"  # the job's outcome, for the standbys
        self.term: Term | None = None

    async def campaign(self, note: Callable[[str], None]) -> Term | str:
        """Lead: at once if nobody does, else once the leader's key is gone. ``note``
        hears, once per leader, who leads meanwhile. The job's outcome instead of a term
        if it ended (under another replica) while this one waited."""
        # the revision as the lease was granted: an end of the run written before then
        # was another job's of the same run id
        lease, since = await asyncio.to_thread(self.client.grant, self.ttl)
        heard = ""
        while True:
            won, reply = await asyncio.to_thread(self._try, lease, since)
            if won:
                self.term = Term(int(reply["header"]["revision"]), lease)
                return self.term
            leader, ended = range_entry(reply, 0), range_entry(reply, 1)
            if ended is not None and ended.mod_revision > since:
                await asyncio.to_thread(self._revoke, lease)
                return ended.value.decode(errors="replace")
            said = leader.value.decode(errors="replace") if leader else "nobody"
            if said != heard:
                note(f"standby: {said} leads run {self.run_id!r}")
                heard = said
            await asyncio.sleep(POLL)
            # keep this replica's lease alive while it waits (granted anew if it lapsed)
            if await asyncio.to_thread(self._renew, lease) <= 0:
                lease, _ = await asyncio.to_thread(self.client.grant, self.ttl)

    def _try(self, lease: int, since: int) -> tuple[bool, dict]:
        key, ended = b64(self.key), b64(self.ended)
        return self.client.txn(
            [
                {"key": key, "target": "CREATE", "create_revision": "0", "result": "EQUAL"},
                {"key": ended, "target": "MOD", "mod_revision": str(since + 1), "result": "LESS"},
            ],
            [
                {"request_put": {"key": key, "value": b64(self.me), "lease": str(lease)}},
                {"request_delete_range": {"key": ended}},  # a past job's end, if any
            ],
            [{"request_range": {"key": key}}, {"request_range": {"key": ended}}],
        )

    def _revoke(self, lease: int) -> None:
        with contextlib.suppress(EtcdUnavailable, EtcdRefused):  # it lapses within ttl
            self.client.revoke(lease)

    def _renew(self, lease: int) -> int:
        return self.client.keepalive(lease, patience=self.ttl)

    def fence(self) -> list[dict]:
        """The comparison every leader's write carries: the leader key is still ours."""
        if self.term is None:
            raise Deposed(f"this coordinator ({self.me}) does not lead run {self.run_id!r}")
        return self.fence_of(self.term)

    def fence_of(self, term: Term) -> list[dict]:
        epoch = str(term.epoch)
        return [
            {"key": b64(self.key), "target": "CREATE", "create_revision": epoch, "result": "EQUAL"}
        ]

    def hold(self, deposed: Callable[[str], None]) -> LeaseKeeper:
        """Renew the lease while leading, on a thread of its own (a coordinator's loop
        busy with ten thousand joins must not lose it); ``deposed(why)`` runs on the
        calling loop if it is lost. The caller stops the keeper when done."""
        assert self.term is not None
        keeper = LeaseKeeper(self.client, self.term.lease, self.ttl)
        keeper.start(asyncio.get_running_loop(), deposed)
        return keeper

    async def conclude(self, outcome: str) -> None:
        """The job ended with ``outcome`` ("finished" or "failed"): say so to the
        standbys (who end too) and hand the key back at once (bounded)."""
        term = self.term
        if term is None:
            return
        self.term = None
        put = {"request_put": {"key": b64(self.ended), "value": b64(outcome)}}
        try:
            await asyncio.to_thread(self.client.txn, self.fence_of(term), [put])
        except (EtcdUnavailable, EtcdRefused) as exc:
            log.warning("could not tell the standbys that the job ended: %s", exc)
        await asyncio.to_thread(self._revoke, term.lease)


class EtcdJournal:
    """The run's journal in etcd, written only under the leader's fence."""

    def __init__(self, leadership: Leadership, run_id: str) -> None:
        self._leadership = leadership
        self._client = leadership.client
        self.run_id = run_id
        self.key = f"/shardwire/{run_id}/journal"
        self.where = f"etcd key {self.key} at {self._client.where}"

    def read(self) -> Journal | None:
        entry = self._client.get(self.key)
        if entry is None:
            return None
        try:
            text = zlib.decompress(entry.value).decode()
        except (zlib.error, UnicodeDecodeError):
            text = ""  # refused below, naming the key
        return parse_journal(text, self.run_id, self.where)

    def write(self, journal: Journal) -> None:
        value = zlib.compress(journal.model_dump_json().encode(), 6)
        self._fenced({"request_put": {"key": b64(self.key), "value": b64(value)}})

    def remove(self) -> None:
        self._fenced({"request_delete_range": {"key": b64(self.key)}})

    def _fenced(self, op: dict) -> None:
        # a leader that cannot write within most of its lease could not lead past it
        patience = self._leadership.ttl * 0.75
        try:
            done, _ = self._client.txn(self._leadership.fence(), [op], patience=patience)
        except (EtcdUnavailable, EtcdRefused) as exc:  # unjournaled, it must not decide
            raise Deposed(f"this coordinator could not journal its decision: {exc}") from exc
        if not done:
            raise Deposed(
                f"this coordinator ({self._leadership.me}) no longer leads: another replica "
                f"holds {self._leadership.key}"
            )


class LeaseKeeper:
    """A leader's lease renewals, on a thread owned by this object (:meth:`stop` joins
    it).

    It renews every ``ttl / 4`` seconds and steps down once a quarter of the TTL is all
    that may be left of the lease (counted from the last renewal that succeeded, as
    sent): before etcd can let the lease lapse and a standby lead, so two replicas never
    serve at once. The verdict reaches the loop only through ``call_soon_threadsafe``.
    """

    def __init__(self, client: EtcdClient, lease: int, ttl: int) -> None:
        self._client = client
        self._lease = lease
        self._ttl = ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, deposed: Callable[[str], None]) -> None:
        def tell(why: str) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(deposed, why)

        self._thread = threading.Thread(
            target=self._run, args=(tell,), name="shardwire-lease", daemon=True
        )
        self._thread.start()

    def _run(self, tell: Callable[[str], None]) -> None:
        every = self._ttl / 4
        last = time.monotonic()  # when the last renewal that succeeded was sent
        while not self._stop.wait(every):
            sent = time.monotonic()
            deadline = last + self._ttl * 0.75
            try:
                remaining = self._client.keepalive(self._lease, patience=max(0.0, deadline - sent))
            except (EtcdUnavailable, EtcdRefused) as exc:
                if time.monotonic() + every < deadline:
                    continue  # it may still renew in time
                tell(f"its etcd lease could not be renewed in time ({exc})")
                return
            if remaining <= 0:
                tell("its etcd lease expired (a standby may lead now)")
                return
            last = sent

    def stop(self) -> None:
        """End the renewals and join the thread (within one call's patience)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._ttl + 1.0)
            self._thread = None
