"""A bare protocol client for poking the coordinator server from tests."""

from __future__ import annotations

import asyncio
from collections import deque

from shardwire.protocol import ClientHandshake, FrameDecoder, Token, frame_message, message_bytes
from shardwire.protocol.messages import Message
from tests.isolation import RUN_ID


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder()
        self.frames: deque = deque()
        self.sent: list[Message] = []

    @classmethod
    async def open(cls, address: tuple[str, int]) -> RawClient:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), 5)
        return cls(reader, writer)

    def send(self, msg: Message) -> None:
        self.sent.append(msg)
        self.writer.write(message_bytes(msg))

    async def recv(self, timeout: float = 5.0) -> Message:
        async with asyncio.timeout(timeout):
            while not self.frames:
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionResetError("closed")
                self.frames.extend(self.decoder.feed(data))
        return frame_message(self.frames.popleft())

    async def closed_by_server(self, timeout: float = 5.0) -> bool:
        async with asyncio.timeout(timeout):
            while await self.reader.read(65536):
                pass
        return True

    async def authenticate(
        self, token: Token, *, run_id: str = RUN_ID, role: str = "worker", generation: int = 0
    ):
        shake = ClientHandshake(token, role=role, run_id=run_id, generation=generation)
        self.send(shake.hello)
        while not shake.done:
            reply = shake.receive(await self.recv())
            if reply is not None:
                self.send(reply)
        return shake

    def close(self) -> None:
        self.writer.close()
