"""Write the generated reference pages of the documentation site:

- ``docs/reference/cli.md``: every command's ``--help``, from the parsers themselves;
- ``docs/reference/environment.md``: every environment variable, from the settings
  models (names, types, defaults and descriptions) and the flags' help texts.

    python scripts/docs_reference.py [--check]

``--check`` writes nothing and exits 1 when a committed page differs from what the code
says now (``make docs`` and the tests run it so).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "reference"
SHARDWIRE = str(Path(sys.executable).parent / "shardwire")
COMMANDS = ["launch", "worker", "run", "coordinator", "status", "checkpoint", "bench", "plot"]
COMMANDS += ["health", "trace", "kubernetes"]
# Read outside the settings models: named here with what they do.
OTHERS = {
    "SHARDWIRE_BENCH_DIR": "Where `shardwire bench` keeps its side environments' files.",
}


def _help(*argv: str) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    command = [SHARDWIRE, *argv, "--help"]
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=120
    )
    if done.returncode != 0:
        raise RuntimeError(f"shardwire {' '.join(argv)} --help failed: {done.stderr}")
    return done.stdout.rstrip()


def _subcommands(text: str) -> list[str]:
    usage = text.split("\n\n", 1)[0]
    found = re.search(r"\{([a-z,-]+)\}", usage)
    return found.group(1).split(",") if found else []


def cli_page() -> str:
    out = [
        "# Command line",
        "",
        "Every command and subcommand's `--help`, as the parsers print it.",
    ]
    queue = [[], *([c] for c in COMMANDS)]
    while queue:
        argv = queue.pop(0)
        text = _help(*argv)
        out += ["", f"## `{' '.join(['shardwire', *argv])}`", "", "```text", text]
        out += ["```"]
        if argv:
            queue[0:0] = [[*argv, sub] for sub in _subcommands(text)]
    return "\n".join(out) + "\n"


def _flag_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> help, over the parser and its subparsers."""
    found: dict[str, str] = {}
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public view
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                for dest, text in _flag_help(sub).items():
                    found.setdefault(dest, text)
        elif action.help and action.help != argparse.SUPPRESS:
            found.setdefault(action.dest, " ".join(action.help.split()))
    return found


def _default(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=False)
    return "unset" if value is None else f"`{value}`"


def _type(info: FieldInfo) -> str:
    text = str(info.annotation).replace("typing.", "").replace("pydantic.types.", "")
    text = re.sub(r"<class '(\w+)'>", r"\1", text)
    return text.replace("SecretStr", "secret").replace(" | None", "")


def _table(model: type[BaseModel], helps: dict[str, str], prefix: str | None) -> list[str]:
    rows = ["| variable | type | default | what it does |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        if info.validation_alias is not None:
            choices = getattr(info.validation_alias, "choices", [info.validation_alias])
            var = str(choices[0])
        else:
            var = f"{prefix}{name.upper()}"
        text = info.description or helps.get(name) or ""
        if not text:
            raise RuntimeError(f"{model.__name__}.{name} has no description and no flag help")
        rows.append(f"| `{var}` | {_type(info)} | {_default(info)} | {text} |")
    return rows


def environment_page() -> str:
    from shardwire.coordinator.__main__ import parser as coordinator_parser
    from shardwire.coordinator.settings import CoordinatorSettings
    from shardwire.worker.launcher.cli import parser as launch_parser
    from shardwire.worker.launcher.settings import LaunchSettings, StatusSettings
    from shardwire.worker.launcher.status import parser as status_parser
    from shardwire.worker.runtime.settings import WorkerEnv

    status_help = _flag_help(status_parser())
    sections = [
        (
            "Every worker process",
            "What `shardwire launch`, `worker` and `run` set for a script, and what a "
            "script started otherwise (torchrun's variables included) may set itself.",
            WorkerEnv,
            {},
        ),
        (
            "`shardwire launch`, `worker` and `run`",
            "Each flag is also `SHARDWIRE_<FLAG>`; a flag on the command line wins.",
            LaunchSettings,
            _flag_help(launch_parser()),
        ),
        (
            "`shardwire coordinator`",
            "Each flag is also `SHARDWIRE_<FLAG>`; a flag on the command line wins.",
            CoordinatorSettings,
            _flag_help(coordinator_parser()),
        ),
        ("`shardwire status`", "The same rule.", StatusSettings, status_help),
    ]
    out = [
        "# Environment variables",
        "",
        "Generated from the settings models: a variable set to a value its type refuses",
        "stops the command with the variable's name and the reason.",
    ]
    for title, intro, model, helps in sections:
        out += ["", f"## {title}", "", intro, "", *_table(model, helps, "SHARDWIRE_")]
    out += ["", "## Others", "", "| variable | what it does |", "|---|---|"]
    out += [f"| `{name}` | {text} |" for name, text in OTHERS.items()]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a page is out of date")
    args = p.parse_args()
    pages = {"cli.md": cli_page(), "environment.md": environment_page()}
    stale = [
        n
        for n, text in pages.items()
        if not (PAGES / n).is_file() or (PAGES / n).read_text() != text
    ]
    if args.check:
        for name in stale:
            print(f"docs/reference/{name} is out of date: run python scripts/docs_reference.py")
        return 1 if stale else 0
    PAGES.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        (PAGES / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
