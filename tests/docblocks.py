"""The console and Python blocks of the README and the docs, each named by the comment
``<!-- block: NAME -->`` above it (a blank line between), so that the test that runs a block reads
it from its page by name (``block("NAME")``) and a block no test reads is found."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LABEL = re.compile(r"^<!-- block: ([a-z0-9-]+) -->$")
_FENCE = re.compile(r"^```(console|python)$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # the fence's line, from 1
    lang: str
    label: str | None
    text: str

    def commands(self) -> list[str]:
        """The commands as a user copies them: each ``$ `` line with its backslash
        continuations, without the prompt."""
        joined = self.text.replace("\\\n", " ")
        return [line[2:] for line in joined.splitlines() if line.startswith("$ ")]

    def output(self) -> list[str]:
        """The lines the block shows printed: every line that is not a command's."""
        shown, command = [], False
        for line in self.text.splitlines():
            if line.startswith("$ ") or command:
                command = line.endswith("\\")
            else:
                shown.append(line)
        return shown


def pages() -> list[Path]:
    """The pages a user reads: the README and the docs (not the generated references)."""
    docs = ROOT / "docs"
    found = [p for p in sorted(docs.rglob("*.md")) if "reference" not in p.parts]
    return [ROOT / "README.md", *found]


def blocks() -> list[Block]:
    found = []
    for page in pages():
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            fence = _FENCE.match(line)
            if not fence:
                continue
            end = lines.index("```", i + 1)
            before = [text for text in lines[:i] if text.strip()]
            label = _LABEL.match(before[-1]) if before else None
            found.append(
                Block(
                    page=str(page.relative_to(ROOT)),
                    line=i + 1,
                    lang=fence.group(1),
                    label=label.group(1) if label else None,
                    text="\n".join(lines[i + 1 : end]) + "\n",
                )
            )
    return found


def block(label: str) -> Block:
    """The block named ``label``: what a test runs, read from its page."""
    (found,) = [b for b in blocks() if b.label == label] or [None]
    if found is None:
        raise AssertionError(f"no block is named {label!r} in the README or the docs")
    return found
