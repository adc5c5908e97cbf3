"""One client process of ``shardwire bench rendezvous``: its share of the simulated
nodes, each a node agent (a real control client that joins for its node and forwards
its workers' heartbeats from its local socket, as ``shardwire worker`` does) and its
workers (real control clients: handshake, join, placement, heartbeats through the
agent, then one lookup of the peers a ring and a hypercube connect it to).

It prints when the first dialled and each worker's join times as one JSON line, then
waits for a line from the driver: ``reform`` has the first worker of the first client
fail (its connection closes) and every other worker re-form in process, as
``Session.reform`` does, while the agents join again and the failed worker's
replacement joins (one more JSON line: the failure's time and when each was placed);
``restart`` answers that it is ready, and once the driver killed the coordinator and
started it again, says when each worker and agent was back; any line then ends the run
(every worker leaves).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from shardwire.protocol import Token
from shardwire.protocol.messages import Join, NodeJoin
from shardwire.protocol.nofile import ensure_nofile
from shardwire.worker.runtime.beats import BeatRelay, NodeBeats
from shardwire.worker.runtime.control import ControlClient

TIMEOUT = 600.0  # seconds for any one wait


def neighbours(rank: int, world: int) -> list[int]:
    """The peers a ring and a hypercube (recursive doubling) connect ``rank`` to."""
    near = {(rank + 1) % world, (rank - 1) % world}
    near |= {rank ^ (1 << k) for k in range(world.bit_length())}
    return sorted(p for p in near if p != rank and p < world)


class Simulated:
    """Workers ``first`` .. ``first + count - 1`` (with their nodes' agents when
    ``agents``: whole nodes); the token comes in SHARDWIRE_TOKEN, never on a command line."""

    def __init__(
        self, port: int, first: int, count: int, world: int, lws: int, *, agents: bool
    ) -> None:
        self.port, self.first, self.count, self.world, self.lws = port, first, count, world, lws
        self.token = Token(os.environ["SHARDWIRE_TOKEN"])
        self.ended = asyncio.Event()  # the coordinator ended generation 1 (re-formation)
        self.restarts: dict[int, asyncio.Event] = {}  # each node's agent heard Restart
        self.clients = [self._worker() for _ in range(count)]
        self.nodes = range(first // lws, (first + count) // lws) if agents else range(0)
        self.agent_of = {k: self._agent(k) for k in self.nodes}
        self.beats = {k: NodeBeats(self.agent_of[k].send, interval=1.0) for k in self.nodes}
        self.ready: dict[int, asyncio.Task[tuple[int, int, str]]] = {}  # agents, owned
        self.relays: list[BeatRelay] = []
        self.placed: dict[int, int] = {}

    def _worker(self) -> ControlClient:
        def aborted(msg: object) -> None:
            if msg is not None:
                self.ended.set()

        return ControlClient(token=self.token, run_id="bench", role="worker", on_abort=aborted)

    def _agent(self, k: int) -> ControlClient:
        heard = self.restarts[k] = asyncio.Event()
        return ControlClient(
            token=self.token, run_id="bench", role="agent", on_generation=lambda _msg: heard.set()
        )

    def _node_join(self, k: int) -> NodeJoin:
        return NodeJoin(
            world_size=self.world, node_id=f"node-{k:06d}", local_world_size=self.lws, node_index=k
        )

    async def agent(self, k: int) -> tuple[int, int, str]:
        """As ``shardwire worker``: join for the node, then its processes start."""
        await self.agent_of[k].connect("127.0.0.1", self.port, timeout=TIMEOUT)
        path = await self.beats[k].start()
        assignment = await self.agent_of[k].node_join(self._node_join(k), timeout=TIMEOUT)
        return assignment.node_rank, assignment.generation, path

    async def one(self, i: int, asked: int | None = None) -> tuple[float, float]:
        """Worker i joins (again, when ``asked``: the rank it had) and gets its peers."""
        node, local = (self.first + i) // self.lws, (self.first + i) % self.lws
        generation, path = 0, ""
        if asked is None and self.nodes:
            node_rank, generation, path = await self.ready[node]
            asked = node_rank * self.lws + local  # its RANK
        start = time.time()
        client = self.clients[i]
        await client.connect("127.0.0.1", self.port, timeout=TIMEOUT)
        if path and asked is not None:  # as a worker's control thread: beats via its agent
            self.relays.append(await BeatRelay.open(path, asked, generation, timeout=60))
            client.relay(self.relays[-1])
        client.start_heartbeats(1.0)  # from the connection on
        msg = Join(
            world_size=self.world,
            node_id=f"node-{node:06d}",
            local_rank=local,
            local_world_size=self.lws,
            listen_port=10000 + (self.first + i) % 50000,
            requested_rank=asked,
        )
        place = await client.join(msg, timeout=TIMEOUT)
        self.placed[i] = place.rank
        members = await client.peers(neighbours(place.rank, self.world), timeout=TIMEOUT)
        assert [m.rank for m in members] == neighbours(place.rank, self.world)
        return start, time.time()

    async def again(self, i: int) -> float:
        """Worker i leaves generation 1 and joins the next with its rank, in the same
        process on a new connection, as ``Session.reform`` does."""
        async with asyncio.timeout(TIMEOUT):
            await self.ended.wait()
        await self.clients[i].aclose()
        self.clients[i] = self._worker()
        _start, done = await self.one(i, asked=self.placed[i])
        return done

    async def rejoin(self, k: int) -> None:
        """An agent under live recovery: on Restart it joins again at once."""
        async with asyncio.timeout(TIMEOUT):
            await self.restarts[k].wait()
        await self.agent_of[k].node_join(self._node_join(k), timeout=TIMEOUT)

    async def reform(self) -> None:
        failed_at = time.time()
        if self.first == 0:  # the failure: its process died, its connection closes
            await self.clients[0].aclose()
            self.clients[0] = self._worker()
        rejoined = [self.rejoin(k) for k in self.nodes]
        dones = await asyncio.gather(*(self.again(i) for i in range(self.count)), *rejoined)
        print(json.dumps({"failed": failed_at, "placed": dones[: self.count]}), flush=True)

    async def restart(self) -> None:
        """The coordinator is killed and started again on its journal: every worker and
        agent reconnects and says who it is; one JSON line: when each was back."""
        print(json.dumps({"ready": True}), flush=True)  # the driver kills it now
        clients = [*self.clients, *self.agent_of.values()]

        async def back(client: ControlClient) -> float:
            await client.away_and_back(TIMEOUT)
            return time.time()

        print(json.dumps({"back": await asyncio.gather(*map(back, clients))}), flush=True)

    async def run(self) -> None:
        ensure_nofile(6 * self.count + 256, "the simulated workers", strict=False)
        first_dial = time.time()
        try:
            for k in self.nodes:
                self.ready[k] = asyncio.create_task(self.agent(k))
            times = await asyncio.gather(*(self.one(i) for i in range(self.count)))
            print(json.dumps({"first": first_dial, "joins": times}), flush=True)
            # the driver says when the beat window is over; read off the loop, so the
            # workers keep heartbeating meanwhile (the window measures exactly that)
            command = (await asyncio.to_thread(sys.stdin.readline)).strip()
            if command in ("reform", "restart"):
                await (self.reform() if command == "reform" else self.restart())
                await asyncio.to_thread(sys.stdin.readline)
            for client in self.clients:
                client.leave()
        finally:
            await self._end()

    async def _end(self) -> None:
        """Close what it made: the agents' tasks (done unless a worker failed first), the
        workers' connections (their heartbeats stop), their relays, then the agents'
        sockets and connections."""
        agents = list(self.ready.values())
        for task in agents:
            task.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
        for client in self.clients:
            await client.aclose()
        for relay in self.relays:
            relay.close()
        for beats in self.beats.values():
            await beats.aclose()
        for agent in self.agent_of.values():
            await agent.aclose()
