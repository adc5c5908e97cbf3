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

    async def hold(self, deposed: Callable[[str], None]) -> None:
        """Renew the lease while leading; on losing it, call ``deposed(why)`` and return.

        It steps down once a quarter of the TTL is all that may be left of its lease
        (counted from the last renewal that succeeded, as sent): before etcd can let the
        lease lapse and a standby lead, so two replicas never serve at once."""
        term = self.term
        assert term is not None
        every = self.ttl / 4
        last = time.monotonic()  # when the last renewal that succeeded was sent
        while True:
            await asyncio.sleep(every)
            sent = time.monotonic()
            deadline = last + self.ttl * 0.75
            try:
                remaining = await asyncio.to_thread(
                    self.client.keepalive, term.lease, patience=max(0.0, deadline - sent)
                )
            except (EtcdUnavailable, EtcdRefused) as exc:
                if time.monotonic() + every < deadline:
                    continue  # it may still renew in time
                deposed(f"its etcd lease could not be renewed in time ({exc})")
                return
            if remaining <= 0:
                deposed("its etcd lease expired (a standby may lead now)")
                return
            last = sent

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
