"""Riding out a coordinator's absence: a refusal or a spent grace ends the wait once,
and the closed connection that follows is no cause to start waiting again."""

from __future__ import annotations

import asyncio

from shardwire.protocol import RendezvousError
from shardwire.protocol.messages import NodeJoin, NodeRejoin
from shardwire.worker.runtime.rejoin import Rejoiner

MESSAGE = NodeRejoin(
    node_rank=0, generation=1, join=NodeJoin(world_size=2, node_id="n0", local_world_size=2)
)


def _rejoiner(refuse: bool, lost: list[str], back: list[bool], gone: asyncio.Event) -> Rejoiner:
    async def dial() -> None:
        if not refuse:
            raise ConnectionRefusedError("refused")

    async def rejoin(_msg: NodeRejoin, _timeout: float) -> None:
        raise RendezvousError("node 'n0' cannot rejoin: the job is waiting", code="rejoin")

    rejoiner = Rejoiner(
        where=lambda: "127.0.0.1:1",
        role="agent",
        dial=dial,
        rejoin=rejoin,
        back=lambda: back.append(True),
        lost=lambda why: (lost.append(why), gone.set()),
    )
    rejoiner.grace, rejoiner.message = 0.5, MESSAGE
    return rejoiner


async def test_a_refusal_ends_the_wait_once() -> None:
    lost: list[str] = []
    back: list[bool] = []
    gone = asyncio.Event()
    rejoiner = _rejoiner(True, lost, back, gone)
    assert rejoiner.start()
    async with asyncio.timeout(10):
        await gone.wait()
    assert len(lost) == 1 and "refused to take it back" in lost[0] and not back
    assert not rejoiner.start()  # the refusal closed the connection: no second wait
    await rejoiner.aclose()


async def test_a_spent_grace_ends_the_wait_once() -> None:
    lost: list[str] = []
    gone = asyncio.Event()
    rejoiner = _rejoiner(False, lost, [], gone)
    assert rejoiner.start()
    async with asyncio.timeout(10):
        await gone.wait()
    assert len(lost) == 1 and "did not come back within 0.5 s" in lost[0]
    assert "refused" in lost[0] and not rejoiner.start()
    await rejoiner.aclose()


async def test_the_client_hears_when_the_coordinator_went_away_and_took_it_back() -> None:
    heard: list[str] = []
    returned = asyncio.Event()

    async def dial() -> None:
        return None

    async def rejoin(_msg: NodeRejoin, _timeout: float) -> None:
        return None

    def back() -> None:
        heard.append("back")
        returned.set()

    rejoiner = Rejoiner(
        where=lambda: "127.0.0.1:1",
        role="worker",
        dial=dial,
        rejoin=rejoin,
        back=back,
        lost=heard.append,
        away=lambda: heard.append("away"),
    )
    rejoiner.grace, rejoiner.message = 5.0, MESSAGE
    assert rejoiner.start() and rejoiner.start()  # a second drop while away: no news
    async with asyncio.timeout(10):
        await returned.wait()
    assert heard == ["away", "back"]
    await rejoiner.aclose()
