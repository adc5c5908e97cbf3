"""The architecture page's "Follow a tensor" is the call path the code takes.

Each ``<!-- path: NAME -->`` list on the page names, step by step, the objects an
all_reduce passes through on one backend. Here that all_reduce runs on a world laid out
for that backend under a profiler, and every object the page names must be one the
call went through: in the page's order for the sending paths, at all for the receiving
one. Every named class must also be defined in the file the page gives for it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests import pathtrace

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
STEP = re.compile(r"^\d+\. `(\w+)`(?: \(`([\w/.]+\.py)`)?", re.M)
# How each path's world is laid out: the node of every rank.
WORLDS = {
    "links": [0, 1],
    "links-receive": [0, 1],
    "arena": [0, 0],
    "tiered": [0, 0, 1, 1],
}
MAX_OBJECTS = 6  # a reader follows any call through at most this many objects
# Every class and module a path runs code of, bounded: the counts measured when the
# bound was set (docs/architecture.md's trace lists), plus two.
BOUNDS = {"links": (28, 35), "arena": (24, 28), "tiered": (39, 44)}


def _paths() -> dict[str, list[tuple[str, str | None]]]:
    text = PAGE.read_text()
    found = {}
    for name, body in re.findall(r"<!-- path: ([\w-]+) -->\n(.*?)<!-- end -->", text, re.S):
        found[name] = STEP.findall(body)
    return found


def test_the_page_follows_every_backend_in_few_objects() -> None:
    paths = _paths()
    assert set(paths) == set(WORLDS)
    for name, steps in paths.items():
        assert 1 < len(steps) <= MAX_OBJECTS, (name, steps)


def test_every_named_class_is_defined_where_the_page_says() -> None:
    for steps in _paths().values():
        for cls, file in steps:
            if not file:
                continue
            folder = {"protocol": "protocol"}.get(file.split("/")[0], "worker")
            path = ROOT / (file if folder == "protocol" else f"worker/{file}")
            tree = ast.parse(path.read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
            assert cls in defined, f"{cls} is not defined in {file}"


def _in_order(wanted: list[str], seen: list[str]) -> bool:
    it = iter(seen)
    return all(any(name == s for s in it) for name in wanted)


@pytest.mark.parametrize("path", sorted(WORLDS))
async def test_the_page_names_the_objects_the_call_passes_through(path: str) -> None:
    wanted = [cls for cls, _file in _paths()[path]]
    seen = list((await pathtrace.trace(WORLDS[path])).order)
    missing = [name for name in wanted if name not in seen]
    assert missing == [], f"{path}: the call never passed through {missing}"
    if path != "links-receive":  # arrivals interleave with the sends
        assert _in_order(wanted, seen), f"{path}: {wanted} out of order in {seen}"


@pytest.mark.parametrize("path", sorted(pathtrace.LAYOUTS))
async def test_a_path_runs_only_what_the_page_lists_and_stays_within_its_bound(
    path: str,
) -> None:
    listed = pathtrace.listed()[path]
    classes, modules = BOUNDS[path]
    assert len(listed.classes) <= classes and len(listed.modules) <= modules, (
        f"{path}: {len(listed.classes)} classes in {len(listed.modules)} modules, past the "
        f"bound of {classes} in {modules}: a new hop on the hot path"
    )
    found = await pathtrace.trace(pathtrace.LAYOUTS[path])
    unlisted = sorted(found.classes - listed.classes) + sorted(found.modules - listed.modules)
    assert unlisted == [], (
        f"{path}: the call ran {unlisted}, which docs/architecture.md does not list "
        "(python -m tests.pathtrace writes the lists again)"
    )
