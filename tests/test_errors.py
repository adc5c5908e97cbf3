"""One error hierarchy: every error the package raises at its users is a ShardwireError
(argument, type and state errors are also the matching builtin), so ``except
ShardwireError`` catches everything shardwire itself reports."""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path

import pytest

import shardwire
from shardwire.protocol import InvalidArgument, InvalidState, InvalidType, ShardwireError

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["protocol", "coordinator", "worker", "torch_bridge", "ray_bridge"]
# Builtins the package may still raise, and why.
ALLOWED = {
    "NotImplementedError",  # abstract methods a subclass overrides
    "ImportError",  # the torch backend without torch installed
    "SystemExit",  # the command line's exit status
    "OSError",  # a system call's errno, inside the node arena (it falls back to TCP)
    "ConnectionResetError",  # a connection's end, inside the transport (becomes PeerFailed)
    "ConnectionError",  # the raw-socket baseline's end of stream
    "LookupError",  # an address book miss, answered by asking the coordinator
    "IndexError",  # a placement's __getitem__: the sequence protocol ends iteration on it
    "AttributeError",  # a package's __getattr__ (PEP 562): hasattr and imports rely on it
}
# Exceptions that never leave the node arena: NodeArena.run turns each into a
# ShardwireError (Poisoned into the poisoning rank's error, Stalled and ArenaTimeout
# into CollectiveTimeout, Mismatch into CollectiveMismatch, Abandoned into JobAborted,
# ReadFailed into PeerFailed or CollectiveError).
ARENA_INTERNAL = {"Poisoned", "Stalled", "ArenaTimeout", "Mismatch", "Abandoned", "ReadFailed"}
BUILTIN_ERRORS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}


def _raised_builtins() -> list[tuple[str, int, str]]:
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Raise) or node.exc is None:
                    continue
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(target, ast.Name) and target.id in BUILTIN_ERRORS:
                    found.append((str(path.relative_to(ROOT)), node.lineno, target.id))
    return found


def test_only_the_listed_builtin_errors_are_raised() -> None:
    raised = _raised_builtins()
    assert raised, "the scan found no raise of a builtin at all: it reads nothing"
    stray = [r for r in raised if r[2] not in ALLOWED]
    assert not stray, f"raise a ShardwireError subclass instead: {stray}"


def _modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(shardwire.__path__, "shardwire."):
        if info.name.startswith("shardwire.torch") or info.name.endswith("__main__"):
            continue  # the torch backend needs torch; its errors are checked below by source
        if info.name.startswith("shardwire.ray") and importlib.util.find_spec("ray") is None:
            continue  # jobs on Ray need the ray extra
        if info.name == "shardwire.worker.bench.torchft_replica":
            continue  # a script run by an interpreter with torchft, which defines no error
        names.append(info.name)
    return names


def test_every_public_error_class_is_a_shardwire_error() -> None:
    classes = {}
    for name in _modules():
        module = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == name:
                classes[f"{name}.{cls_name}"] = cls
    assert len(classes) > 30, sorted(classes)
    stray = sorted(
        q
        for q, cls in classes.items()
        if not issubclass(cls, ShardwireError) and cls.__name__ not in ARENA_INTERNAL
    )
    assert not stray, stray
    from shardwire.worker.fsdp import CheckpointError, FSDPError

    assert issubclass(FSDPError, ShardwireError) and issubclass(CheckpointError, ShardwireError)


def test_torch_backend_errors_by_source() -> None:
    for path in (ROOT / "torch_bridge").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Unavailable")):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                assert "ShardwireError" in bases, (path.name, node.name, bases)


@pytest.mark.parametrize(
    "error, builtin",
    [(InvalidArgument, ValueError), (InvalidType, TypeError), (InvalidState, RuntimeError)],
)
def test_usage_errors_are_also_the_builtin_callers_catch(error, builtin) -> None:
    assert issubclass(error, ShardwireError) and issubclass(error, builtin)


def test_a_rank_blames_the_rank_a_relayed_failure_began_on_but_never_a_timeout() -> None:
    from shardwire.protocol import CollectiveError, CollectiveTimeout, JobAborted, PeerFailed
    from shardwire.protocol.errors import blamed_rank, failure_reason, origin_of, relayed_error

    relayed = relayed_error("CollectiveError", "fault 0 of the chaos plan", 2)
    assert (type(relayed), blamed_rank(relayed)) == (CollectiveError, 2)
    assert failure_reason(relayed) == "raised CollectiveError: fault 0 of the chaos plan"
    timeout = relayed_error("CollectiveTimeout", "all_reduce #3 timed out on rank 2", 2)
    assert isinstance(timeout, CollectiveTimeout) and blamed_rank(timeout) == -1
    assert blamed_rank(CollectiveError("here")) == -1 and blamed_rank(JobAborted("x")) == -1
    died = PeerFailed(rank=3, reason="connection lost")
    assert (blamed_rank(died), failure_reason(died)) == (3, "connection lost")
    # passed on again, an error keeps the rank it began on; one raised here names this rank
    assert origin_of(relayed, 0) == 2 and origin_of(died, 0) == 3
    assert origin_of(CollectiveError("here"), 5) == 5
