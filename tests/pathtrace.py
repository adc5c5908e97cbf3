"""Every object and module a warm all_reduce runs code of, on each backend's path, as a
profiler sees it; and the architecture page's lists of them, generated from that trace.

    python -m tests.pathtrace      (rewrites the page's ``<!-- trace: NAME -->`` blocks)

A path is an all_reduce of 1 MiB of float32 on a world laid out for the backend (the
node of every rank): ``links`` one rank per node, ``arena`` every rank on one node,
``tiered`` two ranks on each of two nodes. Only the second call is traced, so the first
call's detours (dialling a peer, opening an arena) are not part of it. A class counts
when one of its methods runs (``self`` in the frame); a module when any of its code
does: records and helpers too, not only the objects that hand control on.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from shardwire.worker.collectives import Group
from tests.worker.transport.fabric import tcp_world

PAGE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
# How each path's world is laid out: the node of every rank.
LAYOUTS = {"links": [0, 1], "arena": [0, 0], "tiered": [0, 0, 1, 1]}
BLOCK = re.compile(r"(<!-- trace: ([\w-]+) -->\n)(.*?)(<!-- end -->)", re.S)


class Trace(NamedTuple):
    """The classes and the modules (``shardwire.`` left off) one call ran code of, and
    the classes in the order their methods ran (a class again only after another's)."""

    classes: frozenset[str]
    modules: frozenset[str]
    order: tuple[str, ...] = ()


def _profiler(classes: set[str], modules: set[str], order: list[str]) -> Callable[..., Any]:
    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("shardwire."):
            return
        modules.add(module.removeprefix("shardwire."))
        owner = frame.f_locals.get("self")
        if owner is not None:
            name = type(owner).__name__
            classes.add(name)
            if not order or order[-1] != name:
                order.append(name)

    return profile


async def trace(nodes: list[int]) -> Trace:
    """What the second all_reduce on a world laid out as ``nodes`` ran code of."""
    classes: set[str] = set()
    modules: set[str] = set()
    order: list[str] = []
    async with tcp_world(len(nodes), arena=True, nodes=nodes, timeout=30.0) as meshes:
        groups = [Group(m, timeout=30.0) for m in meshes]
        xs = [np.ones(1 << 18, np.float32) for _ in groups]
        try:
            await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
            profile = _profiler(classes, modules, order)
            threading.setprofile(profile)
            sys.setprofile(profile)
            try:
                await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
        finally:
            for g in groups:
                await g.aclose()
    return Trace(frozenset(classes), frozenset(modules), tuple(order))


def render(found: Trace) -> str:
    """A path's block on the page: its counts, then every class and module by name."""
    classes = ", ".join(f"`{c}`" for c in sorted(found.classes))
    modules = ", ".join(f"`{m}`" for m in sorted(found.modules))
    head = f"{len(found.classes)} classes in {len(found.modules)} modules."
    return f"{head}\nClasses: {classes}.\nModules: {modules}.\n"


def listed() -> dict[str, Trace]:
    """The page's lists, by path."""
    found = {}
    for _open, name, body, _end in BLOCK.findall(PAGE.read_text()):
        classes = re.search(r"^Classes: (.*)\.$", body, re.M)
        modules = re.search(r"^Modules: (.*)\.$", body, re.M)
        assert classes and modules, f"the page's trace block {name!r} has no lists"
        found[name] = Trace(
            frozenset(re.findall(r"`([\w.]+)`", classes.group(1))),
            frozenset(re.findall(r"`([\w.]+)`", modules.group(1))),
        )
    return found


def main(runs: int = 3) -> None:
    """Trace every path ``runs`` times and write what any run saw into the page."""
    traces = {}
    for name, nodes in LAYOUTS.items():
        seen = [asyncio.run(trace(nodes)) for _ in range(runs)]
        traces[name] = Trace(
            frozenset().union(*(t.classes for t in seen)),
            frozenset().union(*(t.modules for t in seen)),
        )
    text = PAGE.read_text()
    names = {m.group(2) for m in BLOCK.finditer(text)}
    assert names == set(LAYOUTS), f"the page has trace blocks {sorted(names)}"
    PAGE.write_text(BLOCK.sub(lambda m: m.group(1) + render(traces[m.group(2)]) + m.group(4), text))


if __name__ == "__main__":
    main()
