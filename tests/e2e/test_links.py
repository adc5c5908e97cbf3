"""Where the time goes on a real network: four hosts (network namespaces on a bridge),
one rank each; rank 3 is slowed on purpose and the link from rank 1 to rank 2 is shaped
to 100 Mbit/s with tc. The coordinator's closing lines name both, with figures that
agree with what was injected. Skipped (with the reason) where namespaces or traffic
shaping cannot be made."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.docblocks import block

from .cli import SCRIPTS, env
from .netns import coordinator_inside, make_hosts, worker_inside
from .pageruns import assert_shows

pytestmark = pytest.mark.e2e
SUBNET = "10.77.3"
SHAPED_MBIT = 100


@pytest.fixture
def four_hosts():
    yield from make_hosts(4, subnet=SUBNET, prefix="lk")


def _tc(ns: str, *args: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], check=True, capture_output=True, timeout=10
    )


def shape(ns: str, dst: str, mbit: int) -> None:
    """Limit what ``ns`` sends to ``dst`` to ``mbit`` Mbit/s (htb; a u32 filter picks the
    destination, everything else is unlimited)."""
    found = subprocess.run(
        ["ip", "-n", ns, "-o", "link", "show", "type", "veth"],
        check=True,
        capture_output=True,
        text=True,
        timeout=10,
    )
    dev = found.stdout.split(":")[1].strip().split("@")[0]
    rules = [
        f"qdisc add dev {dev} root handle 1: htb default 10",
        f"class add dev {dev} parent 1: classid 1:10 htb rate 10gbit",
        f"class add dev {dev} parent 1: classid 1:20 htb rate {mbit}mbit",
        f"filter add dev {dev} protocol ip parent 1: prio 1 u32 match ip dst {dst}/32 flowid 1:20",
    ]
    try:
        for rule in rules:
            _tc(ns, *rule.split())
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        why = exc.stderr.decode().strip() if isinstance(exc, subprocess.CalledProcessError) else exc
        pytest.skip(f"cannot shape a link here (tc htb and u32): {why}")


@pytest.mark.timeout(300)
def test_the_slowed_rank_and_the_shaped_link_are_both_named(four_hosts) -> None:
    shape(four_hosts[1], f"{SUBNET}.3", SHAPED_MBIT)  # rank 1 -> rank 2
    token = {"SHARDWIRE_TOKEN": "links-token"}
    address = f"{SUBNET}.1"
    coordinator = coordinator_inside(
        four_hosts[0], address, 29410, world_size=4, run_id="links", env=env(**token)
    )
    procs = [coordinator]
    faults = {"STEPS": "40", "SIZE": str(1 << 18), "SLOW_RANK": "3", "SLOW_SECONDS": "0.15"}
    try:
        for rank, ns in enumerate(four_hosts):
            procs.append(
                worker_inside(
                    ns,
                    f"{address}:29410",
                    str(SCRIPTS / "steps.py"),
                    nnodes=4,
                    nproc=1,
                    node_id=f"host-{rank}",
                    node_rank=rank,
                    run_id="links",
                    env=env(**token, **faults),
                )
            )
        outputs = [p.communicate(timeout=240) for p in procs[1:]]
        assert [p.returncode for p in procs[1:]] == [0] * 4, [e[-2000:] for _, e in outputs]
        _, closing = coordinator.communicate(timeout=60)
        assert coordinator.returncode == 0, closing[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert_shows(block("four-hosts-output").output(), closing)  # the why-slow page's lines
    straggler = re.search(
        r"^straggler: rank 3 \(10\.77\.3\.4\) was last into (\d+)% of its collectives "
        r"\(of the last \d+\), (\d+) ms late on average$",
        closing,
        re.M,
    )
    assert straggler, closing[-3000:]
    assert int(straggler.group(1)) >= 70 and 75 <= int(straggler.group(2)) <= 1000
    slow = re.search(
        r"^slow link: link rank 1 \(10\.77\.3\.2\) -> rank 2 \(10\.77\.3\.3\) \(tcp\) is slow: "
        r"at most ([\d.]+) MB/s against a median of ([\d.]+) MB/s over (\d+) links$",
        closing,
        re.M,
    )
    assert slow, closing[-3000:]
    rate, median = float(slow.group(1)), float(slow.group(2))
    # the shaped rate, and some: tbf lets a burst through above its rate, and a sample of
    # 256 KiB messages read up to twice it here; the unshaped links read 100x more
    assert rate <= SHAPED_MBIT / 8 * 3, closing[-3000:]
    assert median >= 4 * rate
