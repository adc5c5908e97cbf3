"""Run the docs' Python samples named on the command line in this job, each with the
names ``tests/e2e/snippets.py`` gives it, and check what each did; prints
``sample NAME ok`` per sample. ``--session NAME`` runs one sample that starts the
session itself, at the top of the script."""

from __future__ import annotations

import ast
import asyncio
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import shardwire.worker as sw  # noqa: E402
from tests.docblocks import block  # noqa: E402
from tests.e2e.snippets import CONTEXTS, SESSIONS  # noqa: E402


async def _exec(label: str, names: dict) -> None:
    """The sample ``label`` as written, run with ``names`` (top-level await allowed)."""
    code = compile(block(label).text, label, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    done = eval(code, names)  # noqa: S307 (the project's own docs)
    if inspect.iscoroutine(done):
        await done


async def in_group(labels: list[str]) -> None:
    async with sw.init() as pg:
        for label in labels:
            names, check = await CONTEXTS[label](pg)
            await _exec(label, names)
            check(names)
            await pg.barrier()
            print(f"sample {label} ok", flush=True)


async def session(label: str) -> None:
    given, then = SESSIONS[label]
    names = given()
    await _exec(label, names)
    done = then(names)
    if inspect.iscoroutine(done):
        await done
    print(f"sample {label} ok", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--session":
        asyncio.run(session(sys.argv[2]))
    else:
        sw.run(in_group(sys.argv[1:]))
