"""The random generators of a training state: every one the model's modules hold, plus
the caller's (the data order, say), saved and put back by name (checkpoints and peer
copies keep them so a resumed run draws exactly what an uninterrupted one would)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from shardwire.worker.fsdp.wrapper import FSDP


def _generators(fsdp: FSDP, extra: dict[str, np.random.Generator]) -> dict[str, Any]:
    """Every random generator the model's modules hold, plus the caller's, by name."""
    found: dict[str, Any] = {}
    for path, module in fsdp.model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, np.random.Generator):
                found[f"model:{path}.{attr}" if path else f"model:{attr}"] = value
    found.update({f"user:{k}": v for k, v in extra.items()})
    return found


def generator_states(fsdp: FSDP, extra: dict[str, np.random.Generator]) -> dict[str, str]:
    """Every generator's state by name, as JSON text (a state holds integers wider than
    64 bits)."""
    return {name: json.dumps(g.bit_generator.state) for name, g in _generators(fsdp, extra).items()}


def set_generator_states(
    fsdp: FSDP, extra: dict[str, np.random.Generator], saved: dict[str, str]
) -> None:
    """Put back the states :func:`generator_states` gave (those it has)."""
    for name, generator in _generators(fsdp, extra).items():
        if name in saved:
            generator.bit_generator.state = json.loads(saved[name])
