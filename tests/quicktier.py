"""The quick tier (``pytest --quick``, run by ``make check``): every test that starts no
process and opens no namespace. Tests that do are marked ``e2e`` and left out; a test
that is not marked and still starts a process (or enters a namespace) fails in the
quick tier, so the mark cannot drift from what a test does."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


class StartedAProcess(AssertionError):
    """A quick-tier test started a process or entered a namespace."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="only the tests that start no process and open no namespace (not marked "
        "e2e); an unmarked test that starts one fails",
    )


# a module marked e2e as a whole: ``pytestmark = pytest.mark.e2e`` or a one-line list with it
E2E_MODULE = re.compile(r"^pytestmark = (\[[^\]\n]*)?pytest\.mark\.e2e\b", re.MULTILINE)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``--quick``, a test module marked e2e as a whole is not imported at all (every
    test process of the tier would otherwise import it, rewrite its asserts and import
    what it imports, to deselect every test in it); None: pytest decides as usual."""
    if not config.getoption("--quick"):
        return None
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return True if E2E_MODULE.search(collection_path.read_text(encoding="utf-8")) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--quick"):
        return
    kept = [item for item in items if item.get_closest_marker("e2e") is None]
    left = [item for item in items if item.get_closest_marker("e2e") is not None]
    if left:
        config.hook.pytest_deselected(items=left)
    items[:] = kept


def _refuse(what: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise StartedAProcess(
            f"{what} in a quick-tier test: mark the test (or its module) "
            "pytest.mark.e2e, or test it without a process"
        )

    return refused


def _children() -> set[int]:
    """This process's child processes, zombies included."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            found.add(int(entry.name))
    return found


@pytest.fixture(autouse=True)
def _no_process_in_the_quick_tier(request: pytest.FixtureRequest) -> Iterator[None]:
    if not request.config.getoption("--quick"):
        yield
        return
    mp = pytest.MonkeyPatch()
    # Every way the code here starts a process or changes namespace: subprocess (and
    # multiprocessing's spawn through it), fork, posix_spawn, asyncio's subprocesses
    # (uvloop spawns through libuv, below asyncio's functions) and unshare/setns.
    mp.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess.Popen"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "unshare", "setns"):
        if hasattr(os, name):
            mp.setattr(os, name, _refuse(f"os.{name}"))
    for name in ("create_subprocess_exec", "create_subprocess_shell"):
        mp.setattr(asyncio, name, _refuse(f"asyncio.{name}"))
    before = _children()
    try:
        yield
    finally:
        mp.undo()
    # Whatever escaped the patches (a C library's own spawn) still leaves a child.
    started = _children() - before
    if started:
        raise StartedAProcess(f"the test left child processes {sorted(started)}")
