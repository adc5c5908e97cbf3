"""Emulated hosts on shaped links (root: network namespaces and tc tbf): the collectives
benchmark's bus bandwidth stays under the link's rate, and DiLoCo crosses the link with a
fraction of plain data parallel's bytes. Skipped, with the reason, where namespaces or
traffic shaping cannot be made."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from shardwire.worker.bench import across
from shardwire.worker.transport import tcptuning

from .cli import shardwire

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _hosts_possible() -> None:
    if os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None:
        pytest.skip("emulated hosts need root, ip and tc")


@pytest.mark.parametrize(
    ("options", "congestion", "lowat"),
    [
        ([], "cubic", 262144),  # unasked, across hosts: CUBIC and the mark
        (["--tcp-congestion", "reno", "--tcp-notsent-lowat", "65536"], "reno", 65536),
    ],
)
def test_collectives_across_shaped_links_stay_under_the_links_rate(
    tmp_path, options, congestion, lowat
) -> None:
    if not options and not tcptuning.usable("cubic"):
        pytest.skip("this kernel does not give CUBIC to this process")
    out = tmp_path / "hosts.json"
    done = shardwire(
        "bench",
        "collectives",
        "--hosts",
        "2",
        "--link",
        "200mbit",
        "--ops",
        "all_reduce",
        "broadcast",
        "--sizes",
        "4M",
        "--target-s",
        "0.3",
        *options,
        "--json",
        str(out),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["op"], r["hosts"]) for r in rows} == {("all_reduce", 2), ("broadcast", 2)}
    for row in rows:  # shaped: near the link's rate, never above it (unshaped is 10x more)
        assert 0.4 < row["link_fraction"] < 1.05, row
        assert 0.4 < row["default_tcp_link_fraction"] < 1.05, row
        # what the workers' sockets used: shardwire's settings, then the kernel's (the
        # hosts' namespaces' default algorithm, whichever it is, and no mark)
        assert row["tcp"] == {"congestion": [congestion], "notsent_lowat": [lowat]}, row
        assert len(row["default_tcp"]["congestion"]) == 1, row
        assert row["default_tcp"]["notsent_lowat"] == [0], row
    assert report["tcp"]["shardwire"] == {"congestion": [congestion], "notsent_lowat": [lowat]}
    kernel = across.tuning_label(report["tcp"]["default"])
    assert f"shardwire ({congestion}, lowat {lowat >> 10} KiB) | shardwire ({kernel}) |" in (
        done.stdout
    )
    assert "no netem here" in done.stdout


def test_an_exchange_across_hosts_takes_the_ring_where_one_machine_takes_direct(
    tmp_path,
) -> None:
    """The coordinator tells the ranks whether the job is on one machine: an all_gather of
    1 MiB over 2 ranks (512 KiB each) goes direct over loopback, by the ring across hosts."""
    chosen = {}
    for where in (["--hosts", "2", "--link", "1gbit"], ["--world", "2", "--nodes", "2"]):
        out = tmp_path / f"{where[0][2:]}.json"
        done = shardwire(
            "bench",
            "collectives",
            *where,
            "--ops",
            "all_gather",
            "--sizes",
            "1M",
            "--target-s",
            "0.2",
            "--json",
            str(out),
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        chosen[where[0]] = [r["algorithm"] for r in json.loads(out.read_text())["rows"]]
    assert chosen == {"--hosts": ["ring"], "--world": ["direct"]}


def test_several_ranks_per_host_share_its_link_in_tiers(tmp_path) -> None:
    out = tmp_path / "tiers.json"
    done = shardwire(
        "bench",
        "collectives",
        "--hosts",
        "2",
        "--link",
        "200mbit",
        "--ranks-per-host",
        "2",
        "--ops",
        "broadcast",
        "--sizes",
        "4M",
        "--target-s",
        "0.3",
        "--json",
        str(out),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    # the node arena inside each host, the lanes across the link: a broadcast's bytes
    # cross it once, so it stays under the link's rate
    assert (row["n"], row["hosts"], row["algorithm"]) == (4, 2, "tiers")
    assert 0.3 < row["link_fraction"] < 1.05, row


@pytest.mark.long(50)
def test_diloco_crosses_a_slow_link_with_a_fraction_of_the_bytes(tmp_path) -> None:
    out, picture = tmp_path / "slowlink.json", tmp_path / "loss.png"
    done = shardwire(
        "bench",
        "slowlink",
        "--hosts",
        "2",
        "--rates",
        "100mbit",
        "--modes",
        "dp",
        "diloco",
        "--steps",
        "20",
        "--loss-steps",
        "30",
        "--every",
        "10",
        "--log-every",
        "10",
        "--outer-lr",
        "0.7",
        "--outer-momentum",
        "0.9",
        "--json",
        str(out),
        "--plot",
        str(picture),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kept = json.loads(out.read_text())
    rows = {r["mode"]: r for r in kept["rows"]}
    dp, diloco = rows["dp"], rows["diloco"]
    assert dp["steps"] == diloco["steps"] == 20  # timed at the rate
    assert dp["loss_steps"] == diloco["loss_steps"] == 30  # the loss run's
    assert diloco["cross_host_bytes_per_token"] * 8 < dp["cross_host_bytes_per_token"]
    assert diloco["tokens_per_s"] > dp["tokens_per_s"]
    assert diloco["largest_exchange_bytes"] > 0 and dp["largest_exchange_bytes"] is None
    curves = {c["mode"]: c["curve"] for c in kept["curves"]}
    assert [t for t, _loss in curves["dp"]] == [t for t, _loss in curves["diloco"]]
    assert len(curves["dp"]) == 3 and curves["dp"] != curves["diloco"]
    assert (kept["outer_lr"], kept["outer_momentum"]) == (0.7, 0.9)
    assert picture.stat().st_size > 0
