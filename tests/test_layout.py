"""Packaging and layering guards (DESIGN.md section 1)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP = {
    "protocol": "shardwire.protocol",
    "coordinator": "shardwire.coordinator",
    "worker": "shardwire.worker",
    "torch_bridge": "shardwire.torch",
    "ray_bridge": "shardwire.ray",
}

# (folder, banned module prefixes)
RULES = [
    (
        "protocol",
        ["asyncio", "socket", "ssl", "threading", "shardwire.worker", "shardwire.coordinator"],
    ),
    ("coordinator", ["shardwire.worker"]),
    ("worker", ["shardwire.coordinator"]),
    ("torch_bridge", ["shardwire.coordinator"]),
    # the job's coordinator runs as a process of its own: the driver never imports it
    ("ray_bridge", ["shardwire.coordinator"]),
    (
        "worker/collectives",
        [
            "socket",
            "shardwire.worker.transport.mesh",
            "shardwire.worker.transport.memory",
            "shardwire.worker.transport.framing",
        ],
    ),
    (
        "worker/backends",
        [
            "socket",
            "shardwire.worker.transport.mesh",
            "shardwire.worker.transport.memory",
            "shardwire.worker.transport.framing",
        ],
    ),
    ("worker/fsdp", ["shardwire.worker.transport"]),
    ("worker/nn", ["shardwire.worker.transport"]),
    ("worker/optim", ["shardwire.worker.transport"]),
]
BANNED_EVERYWHERE = ["pickle", "marshal", "cPickle", "dill", "cloudpickle"]

# The worker's packages (and top-level modules), lowest first: each imports only those
# listed before it, TYPE_CHECKING imports included (DESIGN.md section 11a). Packages on
# one line stand side by side and do not import each other.
WORKER_LAYERS = [
    ["kernels"],  # reductions, segments, scratch: numpy only
    ["observe"],  # the trace, the flight recorder, where a call's time goes
    ["transport"],  # point-to-point messages: TCP, shared memory, in memory
    ["arena"],  # the node's shared region and its programs
    ["backends"],  # how a group's calls move bytes: links, arena, tiers
    ["collectives"],  # the group: validation, sequence, deadlines, poisoning
    ["parallelism", "optim"],  # the dp x pp x tp mesh; optimizers
    ["nn"],  # layers, tensor and pipeline parallelism
    ["training"],  # data-parallel helpers, compression
    ["fsdp"],
    ["runtime"],  # joining the job: control channel, liveness, settings
    ["chaos"],  # fault plans, their injection into a rank, the verdict
    ["api"],
    ["__init__"],
    ["launcher"],
    ["bench"],
]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _subpackages() -> set[str]:
    found = set()
    for folder, package in TOP.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    return found


def test_every_subpackage_is_listed_for_the_wheel() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == _subpackages()
    assert config["package-dir"] == {pkg: folder for folder, pkg in TOP.items()}


@pytest.mark.parametrize(("folder", "banned"), RULES)
def test_layering(folder: str, banned: list[str]) -> None:
    base = ROOT / folder
    offenders = []
    for path in sorted(base.rglob("*.py")) if base.exists() else []:
        for name in _imports(path):
            if any(name == b or name.startswith(b + ".") for b in banned):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []


def _worker_unit(path: Path) -> str:
    rel = path.relative_to(ROOT / "worker").parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _worker_targets(path: Path) -> set[str]:
    """The worker packages and modules ``path`` imports (by their unit name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = (
                [node.module]
                if node.module != "shardwire.worker"
                else [f"shardwire.worker.{a.name}" for a in node.names]
            )
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["shardwire", "worker"]:
                found.add(parts[2] if len(parts) > 2 else "__init__")
    return found


def test_every_worker_package_has_a_layer() -> None:
    units = {_worker_unit(p) for p in (ROOT / "worker").rglob("*.py")}
    assert units == {u for layer in WORKER_LAYERS for u in layer}


def test_worker_imports_point_down_the_layers() -> None:
    level = {u: i for i, layer in enumerate(WORKER_LAYERS) for u in layer}
    offenders = []
    for path in sorted((ROOT / "worker").rglob("*.py")):
        unit = _worker_unit(path)
        for target in _worker_targets(path) - {unit}:
            if target in level and level[target] >= level[unit]:
                offenders.append(f"{path.relative_to(ROOT)} ({unit}) imports {target}")
    assert offenders == []


def test_the_transport_contract_knows_nothing_of_its_engines() -> None:
    engines = {"mailbox", "messaging", "receive", "mesh", "memory", "framing", "peer", "shm"}
    imported = {
        name.rsplit(".", 1)[-1]
        for name in _imports(ROOT / "worker" / "transport" / "base.py")
        if name.startswith("shardwire.worker.transport.")
    }
    assert imported & engines == set()


def test_no_pickle_and_no_bare_folder_imports() -> None:
    offenders = []
    for folder in TOP:
        for path in (ROOT / folder).rglob("*.py"):
            for name in _imports(path):
                root = name.split(".")[0]
                if root in BANNED_EVERYWHERE or root in TOP:
                    offenders.append(f"{path.relative_to(ROOT)} imports {name}")
            text = path.read_text()
            calls = {
                node.func.id
                for node in ast.walk(ast.parse(text))
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            }
            if "allow_pickle" in text or calls & {"eval", "exec"}:
                offenders.append(f"{path.relative_to(ROOT)} uses eval/exec/allow_pickle")
    assert offenders == []


def test_installed_package_is_the_wheel_layout() -> None:
    import shardwire.protocol

    installed = Path(shardwire.protocol.__file__).resolve()
    assert installed.parent.name == "protocol"
    assert installed.parent.parent.name == "shardwire"


def test_every_installed_module_is_one_of_the_tree_s() -> None:
    """The installed wheel holds no module the tree no longer has (a build directory
    kept between builds would put a deleted module back: ``make sync`` removes it)."""
    import shardwire.protocol

    installed = Path(shardwire.protocol.__file__).resolve().parent.parent
    folders = {"protocol": "protocol", "coordinator": "coordinator", "worker": "worker"}
    folders["torch"] = "torch_bridge"
    folders["ray"] = "ray_bridge"
    ghosts = []
    for path in sorted(installed.rglob("*.py")):
        inside = path.relative_to(installed)
        source = ROOT / folders[inside.parts[0]] / Path(*inside.parts[1:])
        if not source.exists():
            ghosts.append(str(inside))
    assert ghosts == []


def test_no_two_public_classes_share_a_name() -> None:
    """A class's name says which class it is, wherever a reader meets it."""
    where: dict[str, list[str]] = {}
    for folder in ("protocol", "coordinator", "worker", "torch_bridge", "ray_bridge"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}
