"""A replicated state from a live rank: :func:`heal`.

Under data parallelism (DDP) every rank holds the whole model and optimizer state, so
after a re-formation the replacement of a lost rank needs no checkpoint: a survivor has
the state at the newest step. Each rank keeps its model and optimizer from the failed
attempt, and at the start of the next one::

    state = state_of(old_model, old_opt) if old_model is not None else None
    state, step = shardwire.torch.heal(state, step)
    if state is not None:
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

The ranks agree on the newest step any of them holds; the lowest rank holding it sends
its state (the structure as msgpack, then every tensor's bytes in one broadcast) to the
ranks behind it or holding nothing, and every rank ends at that step. Nothing is
written anywhere between failures, and no step done by every survivor is done again.

The state is a tree of dicts, lists and tuples whose leaves are tensors, numbers,
strings, booleans or None (what DCP's ``get_state_dict`` gives for a replicated model);
a sharded leaf (a ``DTensor``: FSDP2) is this rank's alone and is refused: sharded
state comes back through :class:`~shardwire.torch.PeerStorage`. It works over any
``torch.distributed`` backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardwire.protocol import InvalidArgument, InvalidType

_TENSOR = "\x00tensor"  # a leaf: its dtype and shape (its bytes: the next in the table)
_TUPLE = "\x00tuple"  # a tuple (msgpack has lists only)
_REFUSED = -2  # a rank's word for "my state cannot be sent"
ALIGN = 16  # each tensor's bytes start at a multiple of this (a view as any dtype)
_DTYPES = {
    str(dtype): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class Sender:
    """Who sends: the rank and the step it holds (-1: no rank holds a state)."""

    rank: int
    step: int


def choose(steps: list[int]) -> Sender:
    """The lowest rank holding the newest step; ``steps[r]`` is -1 where rank r holds
    nothing."""
    newest = max(steps)
    return Sender(rank=steps.index(newest), step=newest)


def encode(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``state``'s structure (msgpack, tensors replaced by their dtype and shape) and its
    tensors, in the order the structure names them."""
    table: list[torch.Tensor] = []

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, DTensor):
            raise InvalidType(
                f"heal: {path} is a DTensor (a shard of this rank's own, FSDP2); "
                "sharded state comes back through PeerStorage"
            )
        if isinstance(node, torch.Tensor):
            if str(node.dtype) not in _DTYPES:
                raise InvalidType(f"heal: {path} has dtype {node.dtype}, which heal does not send")
            table.append(node.detach())
            return {_TENSOR: [str(node.dtype), list(node.shape)]}
        if isinstance(node, dict):
            return {key: walk(value, f"{path}.{key}") for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            items = [walk(value, f"{path}[{i}]") for i, value in enumerate(node)]
            return {_TUPLE: items} if isinstance(node, tuple) else items
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise InvalidType(f"heal: {path} is a {type(node).__name__}, which heal does not send")

    return msgpack.packb(walk(state, "state"), use_bin_type=True), table


def decode(structure: bytes, flat: torch.Tensor) -> Any:
    """The state ``encode`` described, its tensors cut from ``flat`` (the bytes of every
    tensor in table order, which is the order this walk meets them); the tensors are
    ``flat``'s, not copies."""
    offset = 0

    def build(node: Any) -> Any:
        nonlocal offset
        if isinstance(node, dict) and _TENSOR in node:
            dtype, shape = _DTYPES[node[_TENSOR][0]], node[_TENSOR][1]
            size = math.prod(shape) * dtype.itemsize
            tensor = flat[offset : offset + size].view(dtype).reshape(shape)
            offset += _padded(size)
            return tensor
        if isinstance(node, dict) and _TUPLE in node:
            return tuple(build(value) for value in node[_TUPLE])
        if isinstance(node, dict):
            return {key: build(value) for key, value in node.items()}
        if isinstance(node, list):
            return [build(value) for value in node]
        return node

    return build(msgpack.unpackb(structure, raw=False, strict_map_key=False))


def _padded(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _bytes_of(table: list[torch.Tensor]) -> torch.Tensor:
    """Every tensor's bytes, in order, each from a multiple of ``ALIGN``, in one flat
    uint8 tensor."""
    sizes = [t.numel() * t.element_size() for t in table]
    flat = torch.zeros(sum(_padded(size) for size in sizes), dtype=torch.uint8)
    offset = 0
    for tensor, size in zip(table, sizes, strict=True):
        flat[offset : offset + size] = tensor.contiguous().reshape(-1).view(torch.uint8)
        offset += _padded(size)
    return flat


def heal(
    state: dict[str, Any] | None, step: int, *, group: dist.ProcessGroup | None = None
) -> tuple[dict[str, Any] | None, int]:
    """Every rank of ``group`` (default: the default group) ends with the newest
    replicated state a rank holds. A collective.

    Args:
        state: this rank's state (``get_state_dict``'s model and optimizer dicts and
            anything else the tree form takes) at ``step``, or None where the rank holds
            nothing (a replacement; a fresh start).
        step: the steps ``state`` has taken (ignored with None).

    Returns:
        ``(state, step)``: this rank's own where it already held the newest step, else
        the sender's (fresh tensors); ``(None, 0)`` when no rank holds a state.

    Raises:
        InvalidArgument: a negative ``step``.
        InvalidType: on every rank, where some rank's state has a leaf heal does not
            send (a ``DTensor``: sharded state; an object that is not a tensor,
            number, string, boolean or None).
    """
    if state is not None and step < 0:
        raise InvalidArgument(f"heal: step must be at least 0, got {step}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # each rank checks its own state before the ranks agree, so a state that cannot be
    # sent fails every rank alike instead of leaving the others waiting for it
    refusal: InvalidType | None = None
    structure: bytes = b""
    table: list[torch.Tensor] = []
    mine = -1
    if state is not None:
        try:
            structure, table = encode(state)
            mine = step
        except InvalidType as error:
            refusal, mine = error, _REFUSED
    steps = torch.empty(world, dtype=torch.int64)
    dist.all_gather_into_tensor(steps, torch.tensor([mine], dtype=torch.int64), group=group)
    held = [int(s) for s in steps]
    if refusal is not None:
        raise refusal
    if _REFUSED in held:
        refused = [r for r, s in enumerate(held) if s == _REFUSED]
        raise InvalidType(f"heal: the state of rank(s) {refused} cannot be sent (they say why)")
    source = choose(held)
    if source.step < 0:
        return None, 0
    if all(s == source.step for s in held):
        return state, step
    root = dist.get_global_rank(group, source.rank) if group is not None else source.rank
    if rank == source.rank:
        flat = _bytes_of(table)
        head = torch.tensor([len(structure), flat.numel()], dtype=torch.int64)
    else:
        head = torch.empty(2, dtype=torch.int64)
    dist.broadcast(head, src=root, group=group)
    if rank == source.rank:
        packed = torch.frombuffer(bytearray(structure), dtype=torch.uint8)
    else:
        packed = torch.empty(int(head[0]), dtype=torch.uint8)
        flat = torch.empty(int(head[1]), dtype=torch.uint8)
    dist.broadcast(packed, src=root, group=group)
    if flat.numel():
        dist.broadcast(flat, src=root, group=group)
    if mine == source.step:  # already at the newest step: its own state stands
        return state, step
    return decode(packed.numpy().tobytes(), flat), source.step
