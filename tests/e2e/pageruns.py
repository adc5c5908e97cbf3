"""A page's console block run as a user types it, and its sample output held to what the
run printed: numbers may differ (times, ports, counts that vary), the words may not."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from tests.docblocks import block

from .cli import ROOT, SHARDWIRE, env

_NUMBER = re.compile(r"\d+(?:\\\.\d+)?")


def page_command(label: str) -> tuple[list[str], dict[str, str]]:
    """The one command of block ``label``: its arguments (``shardwire`` being the
    project's) and the variables set before it."""
    (command,) = block(label).commands()
    argv = shlex.split(command)
    variables = {}
    while "=" in argv[0] and not argv[0].startswith("-"):
        name, value = argv.pop(0).split("=", 1)
        variables[name] = value
    if argv[0] in ("shardwire", ".venv/bin/shardwire"):
        argv[0] = SHARDWIRE
    return argv, variables


def run_page_command(
    label: str, where: Path, *, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Block ``label``'s command run in ``where``, a fresh directory in which the
    repository's ``examples/`` and ``tests/`` are where the page's paths expect them."""
    for name in ("examples", "tests"):
        if not (where / name).exists():
            (where / name).symlink_to(ROOT / name)
    argv, variables = page_command(label)
    return subprocess.run(
        argv,
        cwd=where,
        env=env(**variables),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def _pattern(line: str, *, numbers_vary: bool) -> re.Pattern[str]:
    """A sample line as a pattern: anything at ``...``, and any number where it shows
    one unless the numbers must be the same."""
    escaped = re.escape(line)
    if numbers_vary:
        escaped = _NUMBER.sub(r"\\d+(?:\\.\\d+)?", escaped)
    return re.compile(escaped.replace(re.escape("..."), ".*"))


def assert_shows(
    sample: list[str],
    printed: str,
    vary: tuple[tuple[str, str], ...] = (),
    *,
    same_numbers: bool = False,
) -> None:
    """Every line of ``sample`` but ``...`` was printed, in that order (numbers aside,
    unless ``same_numbers``); ``vary`` are substitutions made on both sides first, for
    what differs from run to run."""

    def steady(line: str) -> str:
        for pattern, mark in vary:
            line = re.sub(pattern, mark, line)
        return line

    lines = [steady(line) for line in printed.splitlines()]
    at = 0
    for line in sample:
        if line.strip() == "...":
            continue
        pattern = _pattern(steady(line), numbers_vary=not same_numbers)
        found = next((i for i in range(at, len(lines)) if pattern.fullmatch(lines[i])), None)
        assert found is not None, f"the page shows {line!r}, not printed so:\n{printed[-4000:]}"
        at = found + 1


def page_argv(label: str, given: dict[str, str], *, which: int = 0) -> list[str]:
    """Command ``which`` of block ``label`` with the values of the options in ``given``
    replaced (a test's own addresses, paths and sizes where the page shows a user's);
    every option in ``given`` must be on the page."""
    argv = shlex.split(block(label).commands()[which])
    assert argv[0] == "shardwire", argv
    for option, value in given.items():
        assert option in argv, f"the page's command has no {option}: {argv}"
        argv[argv.index(option) + 1] = value
    return [SHARDWIRE, *argv[1:]]
