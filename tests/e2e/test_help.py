"""The command line shows itself: ``shardwire --help`` lists every command with its
purpose, and every command's own help has examples."""

from __future__ import annotations

import re

import pytest

from shardwire.worker.bench import BENCHES
from shardwire.worker.launcher.cli import TOOLS

from .cli import shardwire

pytestmark = pytest.mark.e2e

COMMANDS = ["launch", "worker", "run", *TOOLS]


def test_the_top_help_lists_every_command_with_its_purpose() -> None:
    done = shardwire("--help")
    assert done.returncode == 0, done.stderr
    for name in COMMANDS:
        assert re.search(rf"^    {name}\b", done.stdout, re.MULTILINE), name
    for name, (_module, purpose) in TOOLS.items():
        assert " ".join(purpose.split()[:3]) in " ".join(done.stdout.split()), name
    assert "examples:" in done.stdout


@pytest.mark.parametrize(
    "command", [*COMMANDS, *(f"bench {name}" for name in BENCHES)], ids=lambda c: c
)
def test_every_command_has_its_own_help_with_examples(command: str) -> None:
    done = shardwire(*command.split(), "--help")
    assert done.returncode == 0, done.stderr
    assert f"usage: shardwire {command}" in done.stdout
    assert "example" in done.stdout, command


def test_an_unknown_command_names_the_known_ones() -> None:
    done = shardwire("nonsense")
    assert done.returncode == 2
    for name in COMMANDS:
        assert name in done.stderr
