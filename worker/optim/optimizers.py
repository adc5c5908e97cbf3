"""Optimizers over flat arrays (whole parameters or shards of them) and an LR schedule.

Updates are elementwise, so updating a shard gives exactly the corresponding slice of
the full update: ZeRO-style sharded optimizer state needs nothing more than passing
shards. State arrays are created on the first step, shaped like their parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeGuard

import numpy as np

from shardwire.protocol.errors import InvalidArgument

# Makes optimizer state array ``name`` for array ``index``, zeros shaped like ``like``.
SlotFactory = Callable[[int, str, np.ndarray], np.ndarray]


class Optimizer:
    """Common bookkeeping: per-parameter state arrays and the step counter."""

    def __init__(self, *, lr: float, weight_decay: float = 0.0) -> None:
        if lr < 0 or weight_decay < 0:
            raise InvalidArgument("lr and weight_decay must be non-negative")
        self.lr = lr
        self.weight_decay = weight_decay
        self.steps = 0
        self.state: list[dict[str, np.ndarray]] = []
        self.slot_factory: SlotFactory | None = None  # where state lives (FSDP offload)

    def _new_slot(self, index: int, name: str, like: np.ndarray) -> np.ndarray:
        if self.slot_factory is None:
            return np.zeros_like(like)
        return self.slot_factory(index, name, like)

    def _slots(self, params: Sequence[np.ndarray], names: Sequence[str]) -> None:
        if not self.state:
            self.state = [{n: self._new_slot(i, n, p) for n in names} for i, p in enumerate(params)]
        if len(self.state) != len(params):
            raise InvalidArgument(
                f"optimizer holds state for {len(self.state)} arrays, step got {len(params)}"
            )

    def state_bytes(self) -> int:
        return sum(a.nbytes for slot in self.state for a in slot.values())

    def state_dict(self) -> dict:
        return {"steps": self.steps, "state": [dict(s) for s in self.state]}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.set_state([{k: np.array(v) for k, v in s.items()} for s in state["state"]])

    def set_state(self, state: Sequence[dict[str, np.ndarray]]) -> None:
        """Adopt ``state`` (one dict of arrays per parameter array); with a slot factory,
        the values are copied into arrays it makes."""
        fresh = []
        for i, slots in enumerate(state):
            mine = {}
            for name, given in slots.items():
                value = np.asarray(given)
                if self.slot_factory is None:
                    mine[name] = value
                    continue
                held = self.state[i].get(name) if i < len(self.state) else None
                if not _fits(held, value):
                    held = self._new_slot(i, name, value)  # else: copy into the one it made
                held[...] = value
                mine[name] = held
            fresh.append(mine)
        self.state = fresh

    def step(
        self,
        params: Sequence[np.ndarray],
        grads: Sequence[np.ndarray],
        *,
        lr: float | None = None,
        after: Callable[[int], None] | None = None,
    ) -> None:
        """Update every array in place; ``after(i)`` is called once array i is done."""
        if len(params) != len(grads):
            raise InvalidArgument(f"{len(params)} parameter arrays but {len(grads)} gradients")
        lr = self.lr if lr is None else lr
        self._prepare(params)
        self.steps += 1
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            self._update(i, p, g, lr)
            if after is not None:
                after(i)

    def _prepare(self, params: Sequence[np.ndarray]) -> None:
        """Create state arrays (first step) and check their count."""

    def _update(self, i: int, p: np.ndarray, g: np.ndarray, lr: float) -> None:
        raise NotImplementedError


def _fits(held: np.ndarray | None, value: np.ndarray) -> TypeGuard[np.ndarray]:
    """Whether an existing state array can take ``value``'s contents."""
    if held is None or held is value:
        return False
    return held.shape == value.shape and held.dtype == value.dtype


class SGD(Optimizer):
    """SGD with momentum (PyTorch's form: v = m v + g; p -= lr v) and L2 weight decay;
    ``nesterov=True`` steps along g + m v instead (PyTorch's Nesterov form)."""

    def __init__(
        self,
        *,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ):
        super().__init__(lr=lr, weight_decay=weight_decay)
        if nesterov and momentum <= 0:
            raise InvalidArgument(f"Nesterov momentum needs momentum > 0, got {momentum}")
        self.momentum = momentum
        self.nesterov = nesterov

    def _prepare(self, params: Sequence[np.ndarray]) -> None:
        if self.momentum:
            self._slots(params, ["velocity"])

    def _update(self, i: int, p: np.ndarray, g: np.ndarray, lr: float) -> None:
        d = g + self.weight_decay * p if self.weight_decay else g
        if self.momentum:
            v = self.state[i]["velocity"]
            v *= self.momentum
            v += d
            d = d + self.momentum * v if self.nesterov else v
        p[...] -= lr * d


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter, 2019)."""

    def __init__(
        self,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        super().__init__(lr=lr, weight_decay=weight_decay)
        self.betas = betas
        self.eps = eps

    def _prepare(self, params: Sequence[np.ndarray]) -> None:
        self._slots(params, ["m", "v"])

    def _update(self, i: int, p: np.ndarray, g: np.ndarray, lr: float) -> None:
        b1, b2 = self.betas
        c1, c2 = 1.0 - b1**self.steps, 1.0 - b2**self.steps
        m, v = self.state[i]["m"], self.state[i]["v"]
        m *= b1
        m += (1.0 - b1) * g
        v *= b2
        v += (1.0 - b2) * g * g
        if self.weight_decay:
            p[...] *= 1.0 - lr * self.weight_decay
        p[...] -= lr * (m / c1) / (np.sqrt(v / c2) + self.eps)


def warmup_cosine(
    step: int, *, base_lr: float, warmup: int, total: int, min_lr: float = 0.0
) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_lr`` at ``total``."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
