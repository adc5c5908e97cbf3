"""A DiLoCo replica's outer state in a safetensors file, written atomically.

The file holds the global parameters, each fragment's outer momentum and an exchange in
flight as tensors, and the counters as metadata; :func:`read` gives back what
:meth:`DiLoCo.state_dict <shardwire.worker.training.diloco.DiLoCo.state_dict>` gave, so
a run resumed from it continues bit for bit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from shardwire.protocol.errors import ShardwireError

KIND = "shardwire-diloco-1"


class OuterStateError(ShardwireError, RuntimeError):
    """A DiLoCo state file that cannot be read: missing, damaged or of another kind."""


def flatten(state: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``state`` as named arrays and JSON-able counters (:func:`unflatten` inverts it)."""
    tensors = {"global": np.ascontiguousarray(state["global"])}
    meta: dict[str, Any] = {
        "steps": state["steps"],
        "behind": state["behind"],
        "outer_steps": [o["steps"] for o in state["outer"]],
        "slots": [sorted(o["state"][0]) if o["state"] else [] for o in state["outer"]],
        "flight": None,
    }
    for i, outer in enumerate(state["outer"]):
        for name, value in (outer["state"][0] if outer["state"] else {}).items():
            tensors[f"outer.{i}.{name}"] = np.ascontiguousarray(value)
    if state["flight"] is not None:
        flight = state["flight"]
        meta["flight"] = {"fragment": flight["fragment"], "started": flight["started"]}
        if flight.get("sent") is not None:
            tensors["flight.sent"] = np.ascontiguousarray(flight["sent"])
        tensors["flight.summed"] = np.ascontiguousarray(flight["summed"])
    return tensors, meta


def write(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` (a temporary file renamed over it: whole or absent)."""
    path = Path(path)
    tensors, meta = flatten(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    save_file(tensors, str(partial), metadata={"kind": KIND, "state": json.dumps(meta)})
    with open(partial, "rb") as f:
        os.fsync(f.fileno())
    os.replace(partial, path)


def read(path: str | Path) -> dict[str, Any]:
    """The state :func:`write` wrote to ``path``."""
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="numpy") as f:
            header = f.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise OuterStateError(f"cannot read DiLoCo state {path}: {exc}") from exc
    if header.get("kind") != KIND:
        raise OuterStateError(f"{path} is not a DiLoCo state file (kind {header.get('kind')!r})")
    return unflatten(tensors, json.loads(header["state"]))


def unflatten(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> dict[str, Any]:
    """The state :func:`flatten` gave ``tensors`` and ``meta`` of (a flight's ``sent``
    None where it was not among them)."""
    outer = []
    for i, (steps, slots) in enumerate(zip(meta["outer_steps"], meta["slots"], strict=True)):
        held = {name: tensors[f"outer.{i}.{name}"] for name in slots}
        outer.append({"steps": steps, "state": [held] if held else []})
    flight = None
    if meta["flight"] is not None:
        flight = {
            **meta["flight"],
            "sent": tensors.get("flight.sent"),
            "summed": tensors["flight.summed"],
        }
    return {
        "steps": meta["steps"],
        "behind": meta["behind"],
        "global": tensors["global"],
        "outer": outer,
        "flight": flight,
    }
