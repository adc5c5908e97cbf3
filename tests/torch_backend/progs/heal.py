"""``shardwire.torch.heal`` on 3 ranks, every case a user meets, in one job.

    python heal.py BACKEND        (as 3 ranks started the way torchrun starts them)

Each case prints ``ok CASE`` on every rank when what it checks held:

- nothing anywhere: no rank holds a state, every rank gets ``(None, 0)``;
- a replacement: ranks 0 and 2 hold a model's and its AdamW's state after 5 steps,
  rank 1 a fresh model and nothing: rank 1 ends with their state bit for bit, set into
  its model and optimizer, and one more step leaves all three alike; the others keep
  their own state objects;
- one step behind: rank 0 holds step 4, ranks 1 and 2 step 5: rank 0 gets step 5 from
  rank 1 (the lowest holding it);
- all alike: every rank at step 5 keeps its own objects, and nothing is sent;
- every leaf kind: tuples, int keys, strings, None, and tensors of mixed dtypes and
  sizes (bool, bfloat16, complex, empty, 0-d) come back as sent;
- a shard: an FSDP2 model's state held by rank 0 is refused, typed, on every rank
  (rank 0 names the DTensor, the others rank 0), and none waits.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import shardwire.torch as swt
from shardwire.protocol import InvalidType


def replica(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A replicated model (each rank trains its copy on the same data here, so ranks can
    stand at different steps without a collective between them)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def step(model: nn.Module, opt: torch.optim.Optimizer, at: int) -> None:
    g = torch.Generator().manual_seed(at)
    opt.zero_grad()
    model(torch.randn(8, 6, generator=g)).square().mean().backward()
    opt.step()


def trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = replica(0)
    for at in range(steps):
        step(model, opt, at)
    return model, opt


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state}


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        found: dict[str, Any] = {}
        for key, value in state.items():
            found |= flat(value, f"{prefix}.{key}")
        return found
    if isinstance(state, (list, tuple)):
        found = {}
        for i, value in enumerate(state):
            found |= flat(value, f"{prefix}[{i}]")
        return found | {f"{prefix}:kind": type(state).__name__}
    return {prefix: state}


def same(a: Any, b: Any) -> bool:
    left, right = flat(a), flat(b)
    if left.keys() != right.keys():
        return False
    for key, value in left.items():
        other = right[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(other, torch.Tensor) or value.dtype != other.dtype:
                return False
            if value.shape != other.shape or not torch.equal(value, other):
                return False
        elif value != other or type(value) is not type(other):
            return False
    return True


def alike_on_every_rank(model: nn.Module) -> bool:
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    theirs = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(theirs, mine)
    return all(torch.equal(mine, t) for t in theirs)


def nothing_anywhere() -> bool:
    return swt.heal(None, 0) == (None, 0)


def a_replacement() -> bool:
    rank = dist.get_rank()
    model, opt = trained(5) if rank != 1 else replica(1)
    mine = state_of(model, opt) if rank != 1 else None
    got, at = swt.heal(mine, 5)
    if at != 5 or got is None or (rank != 1 and got is not mine):
        return False
    if rank == 1:
        reference, reference_opt = trained(5)
        if not same(got, state_of(reference, reference_opt)):
            return False
        set_state_dict(model, opt, model_state_dict=got["model"], optim_state_dict=got["optim"])
    step(model, opt, 5)
    return alike_on_every_rank(model)


def one_step_behind() -> bool:
    rank = dist.get_rank()
    held = 4 if rank == 0 else 5
    model, opt = trained(held)
    got, at = swt.heal(state_of(model, opt), held)
    reference, reference_opt = trained(5)
    return at == 5 and got is not None and same(got, state_of(reference, reference_opt))


def all_alike() -> bool:
    model, opt = trained(5)
    mine = state_of(model, opt)
    got, at = swt.heal(mine, 5)
    return got is mine and at == 5


def every_leaf_kind() -> bool:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7)
    sent = {
        "flag": torch.tensor([True, False, True]),
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "wave": torch.randn(3, 2, generator=g, dtype=torch.complex64),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "counts": torch.arange(7, dtype=torch.int16),
        "betas": (0.9, 0.999),
        "groups": [{"lr": 0.01, "params": [0, 1], "name": "all", "foreach": None}],
        "by_index": {3: torch.ones(2), 11: "eleven"},
    }
    got, at = swt.heal(sent if rank == 2 else None, 9)
    return at == 9 and same(got, sent)


def a_shard() -> bool:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 3))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    rank = dist.get_rank()
    state = {"model": get_state_dict(model, [])[0]} if rank == 0 else None
    try:
        swt.heal(state, 1)
    except InvalidType as error:  # on every rank: the ranks agree on it, none waits
        return ("DTensor" if rank == 0 else "rank(s) [0]") in str(error)
    return False


def main() -> None:
    backend = sys.argv[1]
    dist.init_process_group(backend)
    cases = [
        ("nothing anywhere", nothing_anywhere),
        ("a replacement", a_replacement),
        ("one step behind", one_step_behind),
        ("all alike", all_alike),
        ("every leaf kind", every_leaf_kind),
        ("a shard", a_shard),
    ]
    for name, case in cases:
        if case():
            print(f"ok {name}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
