"""The emulated hosts' pure parts: link rates, the token bucket, the modes' flags, the
TCP settings each collectives run asks for and the columns that say what it used."""

from __future__ import annotations

import argparse

import pytest

from shardwire.protocol import InvalidArgument
from shardwire.worker.bench import collectives
from shardwire.worker.bench.across import (
    KERNEL_TCP,
    _row,
    print_table,
    tcp_report,
    tuning_env,
    tuning_label,
)
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
        "--diloco",
        "50",
        "--replicas",
        "4",
        "--outer-lr",
        "0.7",
        "--outer-momentum",
        "0.9",
    ]
    assert mode_flags("streaming-int8", 2, args(40)) == [
        "--diloco",
        "40",
        "--replicas",
        "2",
        "--outer-lr",
        "1.0",
        "--outer-momentum",
        "0.0",
        "--fragments",
        "4",
        "--overlap",
        "--outer-quantize",
        "int8",
    ]


def test_a_columns_head_says_what_its_sockets_used() -> None:
    # a kept run's settings (one value each) and a run's record (every value used)
    assert tuning_label({"congestion": "cubic", "notsent_lowat": 262144}) == "cubic, lowat 256 KiB"
    assert tuning_label({"congestion": "bbr", "notsent_lowat": None}) == "bbr"
    assert tuning_label({"congestion": ["cubic"], "notsent_lowat": [262144]}) == (
        "cubic, lowat 256 KiB"
    )
    assert tuning_label({"congestion": ["bbr"], "notsent_lowat": [0]}) == "bbr"
    # ranks sharing a host: their own connection keeps the kernel's, the link's is tuned
    mixed = {"congestion": ["bbr", "cubic"], "notsent_lowat": [0, 262144]}
    assert tuning_label(mixed) == "bbr/cubic, lowat none/256 KiB"
    assert tuning_label({"congestion": [], "notsent_lowat": []}) == "kernel's congestion control"


def test_each_run_asks_for_its_settings_and_leaves_the_rest_automatic() -> None:
    assert tuning_env(None) == {} == tuning_env({"congestion": None, "notsent_lowat": None})
    assert tuning_env(KERNEL_TCP) == {
        "SHARDWIRE_TCP_CONGESTION": "kernel",
        "SHARDWIRE_TCP_NOTSENT_LOWAT": "0",
    }
    assert tuning_env({"congestion": "reno", "notsent_lowat": None}) == {
        "SHARDWIRE_TCP_CONGESTION": "reno"
    }


def _rows() -> list[dict]:
    tuned = {
        "op": "all_gather",
        "n": 2,
        "bytes": 1 << 24,
        "algorithm": "ring",
        "median_s": 0.15,
        "tcp": {"congestion": ["cubic"], "notsent_lowat": [262144]},
    }
    kernel = {**tuned, "median_s": 0.16, "tcp": {"congestion": ["bbr"], "notsent_lowat": [0]}}
    gloo = {"median_s": 0.2}
    return [_row(tuned, gloo, 1e9 / 8, 2, kernel)]


def test_the_table_heads_shardwires_columns_with_what_their_sockets_used(capsys) -> None:
    rows = _rows()
    (row,) = rows
    assert row["tcp"] == {"congestion": ["cubic"], "notsent_lowat": [262144]}
    assert row["default_tcp"] == {"congestion": ["bbr"], "notsent_lowat": [0]}
    assert row["link_fraction"] == pytest.approx((1 << 24) / 0.15 / 2 / 1.25e8)  # (n - 1) / n of it
    assert row["default_tcp_vs_gloo"] == pytest.approx(0.2 / 0.16)
    tcp = tcp_report(rows)
    assert tcp == {
        "shardwire": {"congestion": ["cubic"], "notsent_lowat": [262144]},
        "default": {"congestion": ["bbr"], "notsent_lowat": [0]},
    }
    print_table(rows, "1gbit", tcp)
    head = capsys.readouterr().out.splitlines()[1]
    assert "| shardwire (cubic, lowat 256 KiB) | shardwire (bbr) | gloo (bbr) |" in head
    # asked for the kernel's defaults: one shardwire column, headed with them
    alone = [{k: v for k, v in row.items() if not k.startswith("default_tcp")}]
    alone[0]["tcp"] = {"congestion": ["bbr"], "notsent_lowat": [0]}
    print_table(alone, "1gbit", tcp_report(alone))
    head = capsys.readouterr().out.splitlines()[1]
    assert "| shardwire (bbr) | gloo (bbr) |" in head and head.count("shardwire (") == 1


def test_tcp_options_without_hosts_are_refused_even_the_kernels(capsys) -> None:
    assert collectives.main(["--world", "2", "--tcp-notsent-lowat", "0"]) == 2
    assert "give --hosts too" in capsys.readouterr().err
