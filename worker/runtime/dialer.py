"""How a control connection reaches its coordinator: each of its replicas' addresses in
turn, a fresh handshake per attempt, and never a coordinator older than one followed.

A coordinator without replicas has one address. With replicas (etcd), only the leader
listens; a dial tries every address from the one that answered last, so a worker finds
the new leader after a failover in one round. Each ``Welcome`` says the coordinator's
epoch (its leadership); a coordinator whose epoch is older than the one this process
already followed was deposed, and is refused (code ``deposed``) like one not there.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

from shardwire.protocol import ClientHandshake, Limits, RendezvousError, Token
from shardwire.protocol.messages import Message
from shardwire.worker.runtime.attempts import CoordinatorUnreachable, attempts
from shardwire.worker.runtime.notes import WaitNotes
from shardwire.worker.transport.framing import FramedProtocol, open_connection

_CONTROL_LIMITS = Limits(max_payload=0)


class Dialer:
    """The dialing of one control client (owned by it)."""

    def __init__(
        self,
        *,
        token: Token,
        role: str,
        run_id: str,
        generation: int,
        tls: ssl.SSLContext | None,
        on_message: Callable[[Message], None],
        opened: Callable[[FramedProtocol | None], None],
        dialed: Callable[[FramedProtocol], None],
    ) -> None:
        self._token = token
        self._role = role
        self._run_id = run_id
        self._generation = generation
        self._tls = tls
        self._on_message = on_message
        self._opened = opened  # a connection is open (None: it was let go)
        self._dialed = dialed  # its handshake succeeded
        self.addresses: list[tuple[str, int]] = []  # the replicas' (one without etcd)
        self.where = "?"  # the address that answered last, or every address while none has
        self._turn = 0  # the index of the address that answered last
        self.epoch = 0  # the leadership of the coordinator followed: never an older one

    async def reach(self, timeout: float, note_every: float) -> None:
        """Dial until one attempt succeeds: until ``timeout``, retries a name that does
        not resolve yet and refused or unroutable connections (the coordinator, or its
        host's DNS record, may still be starting: a scheduler starts every task at
        once) and "busy" refusals (a burst of joiners), with jittered backoff. While it
        waits, a line every ``note_every`` seconds says for what."""
        named = self.where = ", ".join(f"{h}:{p}" for h, p in self.addresses)
        tries = WaitNotes(f"{self._role}: waiting for the coordinator at {named}", timeout)
        try:
            await tries.around(attempts(self.dial_any, timeout, tries), note_every)
        except TimeoutError:
            raise CoordinatorUnreachable(
                f"no coordinator answered at {named} within {timeout:g} s "
                f"(last attempt: {tries.last})"
            ) from None
        except ssl.SSLError as exc:
            raise CoordinatorUnreachable(
                f"TLS handshake with the coordinator at {named} failed "
                f"({exc.reason or exc}); check --tls-cert/--tls-key/--tls-ca "
                f"(SHARDWIRE_TLS_*) on both sides"
            ) from None
        except ConnectionError:
            hint = "; if it uses TLS, set SHARDWIRE_TLS_CERT/KEY/CA" if self._tls is None else ""
            raise CoordinatorUnreachable(
                f"the coordinator at {named} closed the connection during the handshake{hint}"
            ) from None

    async def dial_any(self) -> FramedProtocol:
        """One attempt: every address in turn, from the one that answered last."""
        n = len(self.addresses)
        first: BaseException | None = None  # of the failures, the one to report
        for k in range(n):
            i = (self._turn + k) % n
            host, port = self.addresses[i]
            try:
                proto = await self._dial(host, port)
            except RendezvousError as exc:
                if n == 1:
                    raise
                if exc.code not in ("busy", "deposed"):  # a replica of another job
                    raise RendezvousError(f"{host}:{port}: {exc}", code=exc.code) from exc
                first = exc  # says more than "not here"
                continue
            except OSError as exc:
                if n == 1:
                    raise
                first = first or exc
                continue
            self._turn = i
            self.where = f"{host}:{port}"
            return proto
        assert first is not None
        raise first

    async def _dial(self, host: str, port: int) -> FramedProtocol:
        """One connection and its handshake (a fresh one: new nonce)."""
        shake = ClientHandshake(
            self._token,
            role=self._role,
            run_id=self._run_id,
            generation=self._generation,
            min_epoch=self.epoch,
        )
        proto = await open_connection(
            lambda: FramedProtocol(shake, limits=_CONTROL_LIMITS, on_message=self._on_message),
            host,
            port,
            ssl=self._tls,
        )
        self._opened(proto)
        try:
            await proto.ready
        except RendezvousError as exc:
            if exc.code in ("busy", "deposed"):
                self._opened(None)
                proto.close()
            raise
        self.epoch = shake.epoch  # a coordinator older than this one is refused from now
        self._dialed(proto)
        return proto
