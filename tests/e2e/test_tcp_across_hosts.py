"""The peer connections' automatic TCP settings between hosts for real: two network
namespaces on a bridge, a rank in each, no TCP variable set; the connection between them
uses CUBIC and the 256 KiB unsent low-water mark, and the explicit spelling of the
kernel's defaults takes both away. Skipped, with the reason, where namespaces cannot be
made."""

from __future__ import annotations

import json
import re

import pytest

from shardwire.worker.transport import tcptuning

from .cli import SCRIPTS, env
from .netns import coordinator_inside, make_hosts, worker_inside

pytestmark = pytest.mark.e2e

SUBNET = "10.77.6"  # apart from the hosts fixture's and the other helpers' namespaces
PORT = 29460
TOKEN = {"SHARDWIRE_TOKEN": "tcp-across-hosts"}  # required off loopback


@pytest.fixture
def two_hosts():
    yield from make_hosts(2, subnet=SUBNET, prefix="tt")


def _used(hosts: list[str], run_id: str, **settings: str) -> dict[int, list[dict]]:
    """A coordinator and rank 0 on the first host, rank 1 on the second; what each
    rank's peer connections used."""
    coordinator = coordinator_inside(
        hosts[0], f"{SUBNET}.1", PORT, world_size=2, run_id=run_id, env=env(**TOKEN)
    )
    procs = [coordinator]
    try:
        for index, ns in enumerate(hosts):
            procs.append(
                worker_inside(
                    ns,
                    f"{SUBNET}.1:{PORT}",
                    str(SCRIPTS / "tcp_used.py"),
                    nnodes=2,
                    nproc=1,
                    node_id=f"host-{index}",
                    node_rank=index,
                    run_id=run_id,
                    env=env(**TOKEN, **settings),
                )
            )
        outputs = [p.communicate(timeout=60) for p in procs[1:]]
        if coordinator.poll() is not None and coordinator.returncode != 0:
            pytest.fail(f"the coordinator failed: {coordinator.communicate()[1][-2000:]}")
        assert [p.returncode for p in procs[1:]] == [0, 0], [e[-2000:] for _, e in outputs]
        assert coordinator.wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = "".join(out for out, _ in outputs)
    used = {int(m[1]): json.loads(m[2]) for m in re.finditer(r"rank (\d+) tcp (\[.*\])", said)}
    assert sorted(used) == [0, 1], said[-2000:]
    return used


@pytest.mark.timeout(300)
def test_a_connection_between_hosts_gets_cubic_and_the_mark_unless_told_otherwise(
    two_hosts,
) -> None:
    if not tcptuning.usable("cubic"):
        pytest.skip("this kernel does not give CUBIC to this process")
    automatic = _used(two_hosts, "tcp-auto")
    assert automatic == {r: [{"congestion": "cubic", "notsent_lowat": 262144}] for r in (0, 1)}
    kernel = _used(
        two_hosts, "tcp-kernel", SHARDWIRE_TCP_CONGESTION="kernel", SHARDWIRE_TCP_NOTSENT_LOWAT="0"
    )
    assert sorted(kernel) == [0, 1] and all(len(ends) == 1 for ends in kernel.values())
    ends = [end for ends in kernel.values() for end in ends]
    # the namespaces' own default algorithm (whichever it is), and no mark of their own
    assert len({end["congestion"] for end in ends}) == 1 and ends[0]["congestion"]
    assert [end["notsent_lowat"] for end in ends] == [0, 0]
