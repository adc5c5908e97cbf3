"""How a model is cut into FSDP units, and its fingerprint."""

from __future__ import annotations

import hashlib

from shardwire.worker.fsdp.strategy import Policy
from shardwire.worker.nn.module import Module


def partition(model: Module, policy: Policy | None) -> list[tuple[str, Module]]:
    """Unit roots in registration (= forward) order; nested matches belong to the outer."""
    roots: list[tuple[str, Module]] = []
    for name, module in model.named_modules():
        if module is model or policy is None:
            continue
        if any(name.startswith(r + ".") for r, _ in roots):
            continue
        if policy(name, module):
            roots.append((name, module))
    return roots


def owned(prefix: str, module: Module) -> list[tuple[str, Module, str]]:
    """(dotted name, owning module, key) of every parameter under ``module``."""
    return [
        (f"{path}.{local}", owner, local)
        for path, owner in module.named_modules(prefix)
        for local in owner.params
    ]


def fingerprint(model: Module) -> str:
    """A short digest of the model's parameter names, shapes and dtypes."""
    text = ";".join(f"{n}:{p.shape}:{p.dtype}" for n, p in model.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]
