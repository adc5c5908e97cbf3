"""The restart and elastic options reach what they configure: flags and SHARDWIRE_*
variables of the coordinator and the launcher."""

from __future__ import annotations

import signal

import pytest
from pydantic import ValidationError

from shardwire.coordinator.__main__ import rendezvous_config, settings_from
from shardwire.protocol import InvalidArgument
from shardwire.protocol.messages import NodeAssignment
from shardwire.worker.launcher.agent import _launch, stop_grace
from shardwire.worker.launcher.cli import launch_settings, parser
from shardwire.worker.launcher.hosted import coordinator_command
from shardwire.worker.launcher.options import LaunchSettings


def test_coordinator_flags_configure_the_rendezvous() -> None:
    config = rendezvous_config(
        settings_from(["--max-restarts", "2", "--nnodes", "1:3", "--last-call", "7.5"])
    )
    assert (config.max_restarts, config.min_nodes, config.last_call) == (2, 1, 7.5)
    plain = rendezvous_config(settings_from([]))
    assert (plain.max_restarts, plain.min_nodes, plain.last_call) == (None, None, 3.0)
    with pytest.raises(InvalidArgument, match="MIN:MAX"):
        settings_from(["--nnodes", "two"])


def test_coordinator_reads_the_restart_budget_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("SHARDWIRE_MAX_RESTARTS", "4")
    assert rendezvous_config(settings_from([])).max_restarts == 4


def test_launch_flags_and_environment(monkeypatch) -> None:
    args = parser().parse_args(
        ["launch", "--standalone", "--max-restarts", "2", "--nnodes", "1:3", "x.py"]
    )
    settings = launch_settings(args)
    assert settings.max_restarts == 2 and settings.node_range == (1, 3)
    monkeypatch.setenv("SHARDWIRE_MAX_RESTARTS", "5")
    assert LaunchSettings().max_restarts == 5
    assert LaunchSettings(nnodes=2).node_range == (2, 2)
    with pytest.raises(ValidationError):
        LaunchSettings(nnodes="3:1")


def test_the_standalone_coordinator_gets_the_restart_budget() -> None:
    command = coordinator_command(LaunchSettings(max_restarts=3, nproc_per_node=4))
    assert command[command.index("--max-restarts") + 1] == "3"
    assert command[command.index("--world-size") + 1] == "4"


def test_ranks_are_forked_unless_the_flag_or_the_variable_says_otherwise(monkeypatch) -> None:
    def forked(*flags: str) -> bool:
        args = parser().parse_args(["launch", "--standalone", *flags, "x.py"])
        return launch_settings(args).fork_ranks

    assert forked() is True
    assert forked("--no-fork") is False
    monkeypatch.setenv("SHARDWIRE_FORK_RANKS", "0")
    assert forked() is False


def test_a_notice_gives_the_ranks_the_leave_timeout_under_live_recovery(monkeypatch) -> None:
    assignment = NodeAssignment(node_rank=0, nnodes=1, world_size=2)

    def launch(*flags: str):
        args = parser().parse_args(["launch", "--standalone", *flags, "x.py"])
        return _launch(launch_settings(args), ["python", "-u", "x.py"], {}, "n", assignment)

    live = ("--max-restarts", "1", "--term-timeout", "2")  # live recovery: the default
    assert stop_grace(launch(*live), signal.SIGTERM) == 30.0  # the default
    assert stop_grace(launch(*live, "--leave-timeout", "60"), signal.SIGTERM) == 60.0
    assert stop_grace(launch(*live, "--leave-timeout", "1"), signal.SIGTERM) == 2.0
    assert stop_grace(launch(*live), signal.SIGINT) is None  # Ctrl-C: --term-timeout
    relaunch = ("--recovery", "relaunch", "--max-restarts", "1")
    assert stop_grace(launch(*relaunch), signal.SIGTERM) is None
    monkeypatch.setenv("SHARDWIRE_LEAVE_TIMEOUT", "45")
    assert stop_grace(launch(*live), signal.SIGTERM) == 45.0
