"""The module base: named parameters and gradients, explicit forward and backward.

A module keeps what its backward needs from the last forward (one forward, then one
backward). ``backward`` *adds* into ``grads`` so micro-batches accumulate until
``zero_grad``. Parameters are always read through ``self.params[name]`` at call time,
so a sharding wrapper can rebind them (gather before use, free after).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class Module:
    """Base class: ``params``/``grads`` by local name, children by name.

    ``ACTIVATIONS`` names the attributes in which a module keeps what its backward needs
    from its forward; :meth:`stash` and :meth:`unstash` save and restore them for the
    whole tree, so several micro-batches can be in flight (pipeline schedules).
    """

    ACTIVATIONS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}
        self.children: dict[str, Module] = {}
        self.training = True

    # ---- structure ---------------------------------------------------------------------

    def add_param(self, name: str, value: np.ndarray) -> np.ndarray:
        self.params[name] = value
        self.grads[name] = np.zeros_like(value)
        return value

    def add(self, name: str, child: Module) -> Module:
        self.children[name] = child
        return child

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix, self
        for name, child in self.children.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
        """(dotted name, array) for every parameter, in a fixed order."""
        for path, module in self.named_modules(prefix):
            for name, value in module.params.items():
                yield (f"{path}.{name}" if path else name), value

    def named_grads(self, prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
        for path, module in self.named_modules(prefix):
            for name, value in module.grads.items():
                yield (f"{path}.{name}" if path else name), value

    def stash(self) -> list[list[object]]:
        """What the last forward left for backward, in every module of the tree."""
        return [[getattr(m, a) for a in m.ACTIVATIONS] for _, m in self.named_modules()]

    def unstash(self, saved: list[list[object]]) -> None:
        """Put back what :meth:`stash` returned, so backward continues that forward."""
        for (_, module), values in zip(self.named_modules(), saved, strict=True):
            for name, value in zip(module.ACTIVATIONS, values, strict=True):
                setattr(module, name, value)

    def zero_grad(self) -> None:
        for _, module in self.named_modules():
            for grad in module.grads.values():
                grad.fill(0)

    def train(self, mode: bool = True) -> Module:
        for _, module in self.named_modules():
            module.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    # ---- computation -------------------------------------------------------------------

    def forward(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def backward(self, dy: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.forward(x)


class Sequential(Module):
    """Children applied in order; backward in reverse."""

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, module in enumerate(modules):
            self.add(str(i), module)

    def __getitem__(self, index: int) -> Module:
        return self.children[str(index)]

    def __len__(self) -> int:
        return len(self.children)

    def forward(self, x: np.ndarray) -> np.ndarray:
        for child in self.children.values():
            x = child.forward(x)
        return x

    def backward(self, dy: np.ndarray) -> np.ndarray:
        for child in reversed(self.children.values()):
            dy = child.backward(dy)
        return dy
