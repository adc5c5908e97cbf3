"""Where each peer listens: asked of the coordinator when this rank first needs it (the
ranks first needed in one loop turn go in one query) and kept for the generation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

from shardwire.protocol.placement import Member

Lookup = Callable[[list[int]], Awaitable[list[Member]]]


async def _nobody(ranks: list[int]) -> list[Member]:
    raise LookupError(f"no address known for ranks {ranks[:8]}")


class AddressBook:
    """Peers' listening addresses, looked up on first need and cached."""

    def __init__(self, lookup: Lookup, known: Mapping[int, tuple[str, int]] | None = None):
        self._lookup = lookup
        self._known: dict[int, tuple[str, int]] = dict(known or {})
        self._asked: dict[int, asyncio.Future[tuple[str, int]]] = {}
        self._batch: list[int] = []
        self._tasks: set[asyncio.Task[None]] = set()  # owned: lookups in flight
        self.queries = 0  # lookups sent (one per batch)

    @classmethod
    def fixed(cls, known: Mapping[int, tuple[str, int]]) -> AddressBook:
        """A book that knows every address already (no coordinator to ask)."""
        return cls(_nobody, known)

    async def address(self, rank: int) -> tuple[str, int]:
        """``rank``'s (host, port); raises what the lookup raised."""
        found = self._known.get(rank)
        if found is not None:
            return found
        future = self._asked.get(rank)
        if future is None:
            loop = asyncio.get_running_loop()
            future = self._asked[rank] = loop.create_future()
            self._batch.append(rank)
            if len(self._batch) == 1:
                loop.call_soon(self._flush)
        return await asyncio.shield(future)

    def _flush(self) -> None:
        ranks, self._batch = self._batch, []
        if ranks:
            task = asyncio.create_task(self._ask(ranks), name="shardwire-address-lookup")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _ask(self, ranks: list[int]) -> None:
        self.queries += 1
        try:
            members = await self._lookup(ranks)
        except Exception as exc:  # every waiter for these ranks hears why
            for rank in ranks:
                future = self._asked.pop(rank)
                future.set_exception(exc)
                future.exception()  # retrieved here: each waiter raises its own copy
            return
        for member in members:
            self._known[member.rank] = (member.host, member.port)
        for rank in ranks:
            future = self._asked.pop(rank)
            if rank in self._known:
                future.set_result(self._known[rank])
            else:
                future.set_exception(LookupError(f"the coordinator did not list rank {rank}"))
                future.exception()

    async def aclose(self) -> None:
        """Cancel the lookups in flight."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for future in self._asked.values():
            future.cancel()
        self._asked.clear()
