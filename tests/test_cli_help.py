"""Every option and positional of every ``shardwire`` command has help text: the walk
goes through each command's own parser (the launcher's, each tool's, each benchmark's)
and their subcommands, nested ones included. Options hidden from ``--help`` on purpose
(``argparse.SUPPRESS``: what a benchmark passes to its own ranks) are not the user's."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator

from shardwire.worker.bench import BENCHES
from shardwire.worker.launcher.cli import TOOLS
from shardwire.worker.launcher.cli import parser as launcher_parser


def _own_parser(module: str) -> argparse.ArgumentParser:
    """The parser a command's module builds (``main`` parses with it)."""
    # the coordinator's command is its package's __main__ (the launcher execs it)
    name = "shardwire.coordinator.__main__" if module == "shardwire.coordinator" else module
    return importlib.import_module(name).parser()


def _commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield "shardwire", launcher_parser()
    for name, (module, _purpose) in TOOLS.items():
        yield f"shardwire {name}", _own_parser(module)
    for name, (module, _purpose) in BENCHES.items():
        yield f"shardwire bench {name}", _own_parser(module)


def _walk(
    command: str, parser: argparse.ArgumentParser
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield command, parser
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public view
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                yield from _walk(f"{command} {name}", sub)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for command, parser in _commands():
        for name, sub in _walk(command, parser):
            # a tool's entry in the launcher's parser is a stand-in (add_help=False, no
            # arguments): its own module's parser, walked too, is the one that parses
            if sub.add_help or name not in found:
                found[name] = sub
    return found


def _without_help(parser: argparse.ArgumentParser) -> list[str]:
    missing = []
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._HelpAction):  # noqa: SLF001 - argparse's own -h
            continue
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for choice in action._choices_actions:  # noqa: SLF001 - each subcommand's line
                if not (choice.help or "").strip():
                    missing.append(f"subcommand {choice.dest}")
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if not (action.help or "").strip():
            missing.append("/".join(action.option_strings) or action.dest)
    return missing


def test_the_walk_reaches_every_command_and_subcommand() -> None:
    parsers = _parsers()
    expected = {"shardwire launch", "shardwire worker", "shardwire run", "shardwire chaos"}
    expected |= {f"shardwire {name}" for name in TOOLS}
    expected |= {f"shardwire bench {name}" for name in BENCHES}
    expected |= {"shardwire trace merge", "shardwire checkpoint consolidate"}
    assert expected <= set(parsers)
    for command, parser in parsers.items():
        assert parser.prog == command  # the parser `shardwire ... --help` prints


def test_every_option_of_every_command_has_help_text() -> None:
    missing = {
        command: names for command, parser in _parsers().items() if (names := _without_help(parser))
    }
    assert missing == {}
