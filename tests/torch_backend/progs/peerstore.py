"""``PeerStorage`` under DCP on 4 ranks, every case a user meets, in one job.

    python peerstore.py        (as 4 ranks started the way torchrun starts them)

Each case prints ``ok CASE`` on every rank when what it checks held:

- bad input before any save: a load raises ``CheckpointUnavailable`` (inside DCP's
  ``CheckpointException``) and ``latest()`` is None;
- FSDP2 -> DDP: an FSDP2 model and its AdamW state saved, loaded into a replicated
  (DDP) model and optimizer: DCP reshards 4 shards into whole tensors; the extra state
  (a step and the random generator's state) comes back;
- DDP -> FSDP2: the other way (DDP's replicated items are written once, by one rank
  each, and read by every rank into its shard);
- async save: ``dcp.async_save`` into the store returns before the save is done; once
  its future is, the checkpoint is the latest and loads as it was saved;
- keep: after 3 saves only the 2 newest are held, ``latest()`` is the newest;
- an id no rank holds: typed, naming what is held;
- another model shape: DCP's planner refuses it;
- damage: rank 2's own part of the newest checkpoint and rank 3's copy of it are
  damaged in memory: ``latest()`` falls back to the older checkpoint on every rank,
  which loads; loading the damaged one names rank 2's part;
- one rank's entry: after saves of one structure (planned once by the ranks), rank 1
  alone adds an entry: every rank plans again, and the entry loads back on rank 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from shardwire.protocol import CheckpointUnavailable
from shardwire.torch import PeerStorage


def net(seed: int, wrap: str) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    if wrap == "ddp":
        return DDP(model)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def trained(seed: int, wrap: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = net(seed, wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(8, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def flat(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict, whole, by its dotted path."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, torch.Tensor):
            out[prefix] = full(value).detach().clone()

    walk("", state)
    return out


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    model_state, optim_state = get_state_dict(model, opt)
    extra = {"step": step, "rng": torch.get_rng_state()}
    return {"model": model_state, "optim": optim_state, "extra": extra}


def unavailable(error: CheckpointException) -> CheckpointUnavailable:
    found = [e for e, _ in error.failures.values() if isinstance(e, CheckpointUnavailable)]
    assert len(found) == len(error.failures), error
    return found[0]


def bad_input_before_any_save(store: PeerStorage) -> None:
    assert store.latest() is None
    model, opt = trained(0, "fsdp2")
    try:
        dcp.load(state_of(model, opt, 0), checkpoint_id="step-1", storage_reader=store)
    except CheckpointException as error:
        assert "nothing was saved" in str(unavailable(error)), error
    else:
        raise AssertionError("a load before any save went through")


def round_trip(store: PeerStorage, saved_as: str, loaded_as: str, name: str) -> None:
    model, opt = trained(0, saved_as)
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    dcp.save(state_of(model, opt, 7), checkpoint_id=name, storage_writer=store)
    expected = flat(state_of(model, opt, 7)["model"]) | flat(state_of(model, opt, 7)["optim"])
    torch.manual_seed(99)
    other, other_opt = trained(5, loaded_as)  # other values, another layout
    state = state_of(other, other_opt, 0)
    assert store.latest() == name
    dcp.load(state, checkpoint_id=name, storage_reader=store)
    set_state_dict(
        other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    got = flat(state_of(other, other_opt, 0)["model"]) | flat(
        state_of(other, other_opt, 0)["optim"]
    )
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert state["extra"]["step"] == 7
    assert torch.equal(state["extra"]["rng"], rng)


def saved_in_the_background(store: PeerStorage) -> None:
    model, opt = trained(0, "fsdp2")
    expected = flat(state_of(model, opt, 8)["model"]) | flat(state_of(model, opt, 8)["optim"])
    pending = dcp.async_save(state_of(model, opt, 8), checkpoint_id="c", storage_writer=store)
    pending.result(timeout=60)
    assert store.latest() == "c", store.latest()
    other, other_opt = trained(5, "fsdp2")
    state = state_of(other, other_opt, 0)
    dcp.load(state, checkpoint_id="c", storage_reader=store)
    set_state_dict(
        other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    got = flat(state_of(other, other_opt, 0)["model"]) | flat(
        state_of(other, other_opt, 0)["optim"]
    )
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert state["extra"]["step"] == 8


def keeps_the_newest(store: PeerStorage) -> None:
    model, opt = trained(0, "fsdp2")
    for step in (10, 20, 30):
        dcp.save(state_of(model, opt, step), checkpoint_id=f"step-{step}", storage_writer=store)
    assert store.checkpoints == ["step-30", "step-20"], store.checkpoints
    assert store.latest() == "step-30"


def one_rank_changes(store: PeerStorage) -> None:
    """After saves of one structure (whose plans the ranks agreed once), rank 1 alone
    adds an entry: every rank plans again, and the entry is saved and loads back."""
    model, opt = trained(0, "fsdp2")
    rank = dist.get_rank()
    state = state_of(model, opt, 40)
    if rank == 1:
        state["extra"]["note"] = torch.arange(5.0)
    dcp.save(state, checkpoint_id="step-40", storage_writer=store)
    again = state_of(*trained(3, "fsdp2"), 0)
    if rank == 1:
        again["extra"]["note"] = torch.zeros(5)
    dcp.load(again, checkpoint_id="step-40", storage_reader=store)
    assert again["extra"]["step"] == 40
    if rank == 1:
        assert torch.equal(again["extra"]["note"], torch.arange(5.0)), again["extra"]["note"]


def unknown_id(store: PeerStorage) -> None:
    model, opt = trained(0, "fsdp2")
    try:
        dcp.load(state_of(model, opt, 0), checkpoint_id="step-5", storage_reader=store)
    except CheckpointException as error:
        said = str(unavailable(error))
        assert "no live rank holds checkpoint 'step-5'" in said and "step-30" in said, said
    else:
        raise AssertionError("a checkpoint no rank holds was loaded")


def another_shape() -> None:
    store = PeerStorage()
    model, opt = trained(0, "fsdp2")
    dcp.save({"model": get_state_dict(model, opt)[0]}, checkpoint_id="a", storage_writer=store)
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    try:
        dcp.load({"model": wide.state_dict()}, checkpoint_id="a", storage_reader=store)
    except CheckpointException as error:
        assert "Size mismatch" in str(error) or "size" in str(error).lower(), error
    else:
        raise AssertionError("a checkpoint of another shape was loaded")


def damaged(store: PeerStorage) -> None:
    rank = dist.get_rank()
    # rank 2's own part of step-30 and the copy rank 3 holds of it
    key = ("step-30", 2)
    if rank in (2, 3):
        part = store._parts[key]
        part.data = part.data.copy()
        part.data[0] ^= 0xFF
    assert store.latest() == "step-20"
    try:
        model, opt = trained(0, "fsdp2")
        dcp.load(state_of(model, opt, 0), checkpoint_id="step-30", storage_reader=store)
    except CheckpointException as error:
        said = str(unavailable(error))
        assert "not whole" in said and "ranks [2]" in said and "'step-20'" in said, said
    else:
        raise AssertionError("a damaged checkpoint was loaded")
    model, opt = trained(3, "fsdp2")
    state = state_of(model, opt, 0)
    dcp.load(state, checkpoint_id="step-20", storage_reader=store)
    assert state["extra"]["step"] == 20
    if rank in (2, 3):
        assert any("failed its digest" in said for said in store.refused), store.refused


def main() -> None:
    dist.init_process_group("shardwire")
    store = PeerStorage()
    cases = [
        ("bad input before any save", lambda: bad_input_before_any_save(store)),
        ("FSDP2 -> DDP", lambda: round_trip(store, "fsdp2", "ddp", "a")),
        ("DDP -> FSDP2", lambda: round_trip(store, "ddp", "fsdp2", "b")),
        ("async save", lambda: saved_in_the_background(store)),
        ("keep", lambda: keeps_the_newest(store)),
        ("an id no rank holds", lambda: unknown_id(store)),
        ("another model shape", another_shape),
        ("damage", lambda: damaged(store)),
        ("one rank's entry", lambda: one_rank_changes(store)),
    ]
    for name, case in cases:
        case()
        dist.barrier()
        print(f"ok {name}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
