"""Optional TLS with mutual authentication: jobs run over it with identical results;
clients without a certificate of the job's CA are refused by the coordinator and by the
peer listeners; a byte flipped on the wire is rejected by TLS itself."""

from __future__ import annotations

import asyncio
import ssl

import numpy as np
import pytest

from shardwire.coordinator.tls import server_context
from shardwire.protocol import PeerFailed
from shardwire.worker import init
from shardwire.worker.collectives import Group
from shardwire.worker.runtime.control import ControlClient, CoordinatorUnreachable
from shardwire.worker.runtime.tls import TlsConfigError, TlsFiles
from shardwire.worker.transport import MeshConfig, TcpMesh
from shardwire.worker.transport.dialing import ConnectFailed
from tests.e2e.abuse import FlipProxy
from tests.worker.cluster import TOKEN as CLUSTER_TOKEN
from tests.worker.cluster import coordinator, worker_config

from .fabric import TOKEN, book_for, close_all, placement_for


def _coordinator_tls(files: TlsFiles) -> ssl.SSLContext:
    ctx = server_context(files.cert, files.key, files.ca)
    assert ctx is not None
    return ctx


async def test_a_job_runs_over_tls_with_exact_results(certificates) -> None:
    tls = certificates.member
    async with coordinator(3, tls=_coordinator_tls(tls)) as server:

        async def worker(i: int) -> np.ndarray:
            async with init(worker_config(server, 3, i, tls=tls)) as pg:
                return await pg.all_reduce(np.arange(300_000.0) * (pg.rank + 1))

        results = await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(3))), 60)
        for r in results:
            np.testing.assert_array_equal(r, np.arange(300_000.0) * 6)


def _credentials(certificates, who: str) -> TlsFiles | None:
    """A client's TLS files: none ("plain"); another CA's certificate and trust, so it
    refuses the job's certificate too ("stranger"); another CA's certificate trusting the
    job's CA, so only the job's side can refuse it ("impostor")."""
    stranger = certificates.stranger
    if who == "impostor":
        return TlsFiles(cert=stranger.cert, key=stranger.key, ca=certificates.member.ca)
    return None if who == "plain" else stranger


# asyncio (and uvloop) drops a connection whose TLS handshake fails without sending the
# alert, so a refused client sees the connection closed, not a TLS error.
@pytest.mark.parametrize(
    ("who", "refusal"),
    [
        ("plain", r"closed the connection during the handshake; if it uses TLS, set SHARDWIRE"),
        ("stranger", r"TLS handshake with the coordinator .* failed \(CERTIFICATE_VERIFY_FAILED"),
        ("impostor", r"closed the connection during the handshake$"),
    ],
)
async def test_the_coordinator_refuses_clients_without_the_jobs_certificate(
    certificates, who, refusal
) -> None:
    async with coordinator(1, tls=_coordinator_tls(certificates.member)) as server:
        files = _credentials(certificates, who)
        tls = files.client_context() if files is not None else None
        client = ControlClient(token=CLUSTER_TOKEN, run_id="test", role="client", tls=tls)
        try:
            with pytest.raises(CoordinatorUnreachable, match=refusal):
                await client.connect(*server.address, timeout=5)
        finally:
            await client.aclose()


async def _mesh_pair(certs, dialer: TlsFiles | None, detour: FlipProxy | None = None):
    """Rank 0 listens with the job's certificate; rank 1 dials with ``dialer``."""
    member = certs.member
    meshes = [
        TcpMesh(
            MeshConfig(
                run_id="test",
                token=TOKEN,
                tls_server=member.server_context(),
                tls_client=member.client_context(),
                handshake_timeout=5,
                connect_timeout=2,
            ),
            timeout=10,
        ),
        TcpMesh(
            MeshConfig(
                run_id="test",
                token=TOKEN,
                tls_server=dialer.server_context() if dialer else None,
                tls_client=dialer.client_context() if dialer else None,
                connect_timeout=2,
            ),
            timeout=10,
        ),
    ]
    ports = [await m.listen() for m in meshes]
    dial_ports = list(ports)
    if detour is not None:
        detour.target = ("127.0.0.1", ports[0])
        dial_ports[0] = await detour.start()
    meshes[0].start(placement_for(2, 0), book_for(ports))
    meshes[1].start(placement_for(2, 1), book_for(dial_ports))
    return meshes


@pytest.mark.parametrize(
    ("who", "error", "refusal"),
    [
        ("plain", PeerFailed, r"no connection with rank 0 at .* \(connection closed\)"),
        # the listener's certificate is not the job's: refused at once, not retried
        ("stranger", ConnectFailed, r"rank 1: cannot connect to rank 0 at .*CERTIFICATE_VERIFY"),
        ("impostor", PeerFailed, r"no connection with rank 0 at .* \(connection closed\)"),
    ],
)
async def test_a_peer_listener_refuses_dialers_without_the_jobs_certificate(
    certificates, who, error, refusal
) -> None:
    meshes = await _mesh_pair(certificates, _credentials(certificates, who))
    try:
        with pytest.raises(error, match=refusal):
            async with asyncio.timeout(30):
                await meshes[1].ensure([0])
        assert meshes[0].connection(1) is None  # the dialer never got in
    finally:
        for m in meshes:
            await m.aclose()


async def test_with_tls_a_flipped_byte_breaks_the_link_instead_of_the_result(
    certificates,
) -> None:
    proxy = FlipProxy(("", 0), part="stream", offset=200_000)  # well past the handshakes
    meshes = await _mesh_pair(certificates, certificates.member, proxy)
    groups: list[Group] = []
    try:
        async with asyncio.timeout(10):
            await meshes[1].ensure([0])  # through the proxy
        groups = [Group(m, timeout=10) for m in meshes]
        x = np.arange(200_000.0)
        async with asyncio.timeout(30):
            results = await asyncio.gather(
                *(g.all_reduce(x.copy()) for g in groups), return_exceptions=True
            )
        assert proxy.flipped == 1
        # 1.6 MB take the ring; the flip lands in the half rank 1 sends in its
        # reduce-scatter, so rank 0 refuses that record and rank 1 never receives rank
        # 0's reduced half: neither rank returns a result.
        assert isinstance(results[0], PeerFailed) and results[0].rank == 1, results
        assert "DECRYPTION_FAILED_OR_BAD_RECORD_MAC" in results[0].reason, results
        assert isinstance(results[1], PeerFailed) and results[1].rank == 0, results
    finally:
        await close_all(groups, meshes, [proxy])


def test_tls_files_must_come_together(certificates) -> None:
    files = certificates.member
    assert TlsFiles.from_values(None, None, None) is None
    with pytest.raises(TlsConfigError, match="must be given together"):
        TlsFiles.from_values(files.cert, None, files.ca)
    with pytest.raises(TlsConfigError, match="does not exist"):
        TlsFiles.from_values(files.cert, files.key, "/nonexistent/ca.pem")
    env = TlsFiles.from_env(files.env())
    assert env == files
