"""The benchmark commands on the pages: each one whose figures a page quotes is the
command those figures came from (its output kept in ``docs/data/bench`` with its date,
commit and machine), and every option a command shows is one its benchmark takes. As
written they run for minutes; the suite runs each benchmark small in its own tests."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

from .docblocks import block

ROOT = Path(__file__).resolve().parent.parent
KEPT = {
    "bench-goodput": "goodput.json",
    "bench-goodput-torchft": "goodput-torchft.json",
    "bench-copies": "copies.json",
    "bench-reform": "reform.json",
    "bench-hosts": "hosts.json",
    "bench-slowlink": "slowlink.json",
    "bench-ray": "ray.json",
}
OUTPUTS = {"--json", "--plot"}  # where the output goes: a user's own paths


def _options(command: str) -> tuple[str, dict[str, list[str]]]:
    """The benchmark a command runs and its options with their values, in any order."""
    words = shlex.split(command.split("  #", maxsplit=1)[0])
    at = words.index("bench")
    name, options, current = words[at + 1], {}, None
    for word in words[at + 2 :]:
        if word.startswith("--"):
            current = word
            options[current] = []
        else:
            assert current is not None, command
            options[current].append(word)
    return name, {k: v for k, v in options.items() if k not in OUTPUTS}


@pytest.mark.parametrize("label", sorted(KEPT))
def test_a_benchmark_command_on_a_page_is_the_one_its_kept_figures_came_from(label) -> None:
    kept = json.loads((ROOT / "docs" / "data" / "bench" / KEPT[label]).read_text())
    (command,) = block(label).commands()
    assert _options(command) == _options(kept["benchmark"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", kept["date"]) and kept["commit"] and kept["machine"]


def test_every_option_a_benchmark_command_shows_is_one_its_benchmark_takes() -> None:
    reference = (ROOT / "docs" / "reference" / "cli.md").read_text()
    labels = [*KEPT, "bench-commands"]
    commands = [c for label in labels for c in block(label).commands()]
    assert len(commands) >= 15
    for command in commands:
        name, options = _options(command)
        section = reference.split(f"## `shardwire bench {name}`", 1)[1].split("\n## ", 1)[0]
        for option in options:
            assert re.search(rf"{option}\b", section), (command, option)


@pytest.mark.e2e
def test_a_kept_run_holds_its_command_date_commit_machine_and_output(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("keep_bench", ROOT / "scripts" / "keep_bench.py")
    assert spec is not None and spec.loader is not None
    keep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(keep)
    command = ["shardwire", "bench", "checkpoint", "--world", "1", "--mib", "1"]
    assert keep.main(["probe", "a test machine", "--", *command], kept=tmp_path) == 0
    kept = json.loads((tmp_path / "probe.json").read_text())
    assert kept["benchmark"] == " ".join(command) and kept["machine"] == "a test machine"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", kept["date"]) and re.fullmatch(
        r"[0-9a-f]{7,}", kept["commit"]
    )
    (row,) = kept["result"]
    assert row["n"] == 1 and row["save_s"] > 0
