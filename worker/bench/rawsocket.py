"""Raw-socket ceiling: two processes over loopback sending to each other at once.

Each side runs a sender thread (blocking ``sendall``) and a receiver (``recv_into`` a
preallocated buffer) concurrently, so the figure is what one direction gets while the
other direction is busy too, as in a two-rank all_reduce.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

_REPS = 8


def _pump(sock: socket.socket, nbytes: int) -> float:
    payload = memoryview(bytearray(b"\x01" * nbytes))
    inbox = memoryview(bytearray(nbytes))

    def send() -> None:
        for _ in range(_REPS):
            sock.sendall(payload)

    sender = threading.Thread(target=send)
    start = time.perf_counter()
    sender.start()
    for _ in range(_REPS):
        view = inbox
        while view:
            got = sock.recv_into(view)
            if not got:
                raise ConnectionError("peer closed")
            view = view[got:]
    sender.join()
    return nbytes * _REPS / (time.perf_counter() - start)


def two_way_throughput(nbytes: int, trials: int = 3) -> float:
    """Best bytes/s in one direction while both directions run, over ``trials``."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    peer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardwire.worker.bench.rawsocket",
            str(port),
            str(nbytes),
            str(trials),
        ]
    )
    try:
        sock, _ = server.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        best = max(_pump(sock, nbytes) for _ in range(trials))
        sock.close()
    finally:
        server.close()
        peer.wait(timeout=120)
    return best


def _peer_main() -> None:
    port, nbytes, trials = (int(a) for a in sys.argv[1:4])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(trials):
        _pump(sock, nbytes)
    sock.close()


if __name__ == "__main__":
    _peer_main()
