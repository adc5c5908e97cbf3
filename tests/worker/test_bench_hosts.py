"""The emulated hosts' pure parts: link rates, the token bucket, the modes' flags."""

from __future__ import annotations

import argparse

import pytest

from shardwire.protocol import InvalidArgument
from shardwire.worker.bench.hosts import Hosts, rate_bits, tbf_rule
from shardwire.worker.bench.slowlink import mode_flags


@pytest.mark.parametrize(
    ("rate", "bits"), [("100mbit", 1e8), ("1gbit", 1e9), ("2.5Gbit", 2.5e9), ("512kbit", 512e3)]
)
def test_rates_read_as_tc_writes_them(rate: str, bits: float) -> None:
    assert rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["fast", "100", "1gbps", "-1gbit", "0mbit"])
def test_a_rate_tc_would_not_take_is_refused(rate: str) -> None:
    with pytest.raises(InvalidArgument, match="link rate"):
        rate_bits(rate)


def test_the_bucket_holds_4_ms_at_the_rate_and_at_least_64_kib() -> None:
    fast = tbf_rule("eth0", "1gbit")
    assert fast[:6] == ["qdisc", "replace", "dev", "eth0", "root", "tbf"]
    assert fast[fast.index("rate") + 1] == "1gbit"
    assert int(fast[fast.index("burst") + 1]) == 500_000
    slow = tbf_rule("eth0", "10mbit")
    assert int(slow[slow.index("burst") + 1]) == 64 * 1024


def test_hosts_are_named_apart_per_process_and_need_two() -> None:
    hosts = Hosts(3, "1gbit")
    assert [hosts.address(i) for i in range(3)] == ["10.79.0.1", "10.79.0.2", "10.79.0.3"]
    assert len(set(hosts.names)) == 3 and all(len(hosts.device(i)) <= 15 for i in range(3))
    assert hosts.prefix(1) == ["ip", "netns", "exec", hosts.names[1]]
    with pytest.raises(InvalidArgument, match="at least 2 hosts"):
        Hosts(1, None)


def test_each_mode_is_the_examples_flags() -> None:
    def args(every: int, lr: float = 1.0, momentum: float = 0.0) -> argparse.Namespace:
        return argparse.Namespace(every=every, fragments=4, outer_lr=lr, outer_momentum=momentum)

    assert mode_flags("dp", 2, args(50)) == []
    assert mode_flags("diloco", 4, args(50, 0.7, 0.9)) == [
        "--diloco", "50", "--replicas", "4", "--outer-lr", "0.7", "--outer-momentum", "0.9",
    ]  # fmt: skip
    assert mode_flags("streaming-int8", 2, args(40)) == [
        "--diloco", "40", "--replicas", "2", "--outer-lr", "1.0", "--outer-momentum", "0.0",
        "--fragments", "4", "--overlap", "--outer-quantize", "int8",
    ]  # fmt: skip
