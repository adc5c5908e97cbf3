"""``PeerStorage``: DCP checkpoints in the ranks' memory. Its pure core in one process
(the wire form of a part, the metadata rebuilt as DCP's planner made it, which
checkpoints the live ranks can restore), and every case a user meets on 4 real ranks."""

from __future__ import annotations

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument

from .lazy import Lazy, skip_without_torch
from .spawn import run_ranks

skip_without_torch()
torch = Lazy("torch")
default_planner = Lazy("torch.distributed.checkpoint.default_planner")
planner = Lazy("torch.distributed.checkpoint.planner")
pp = Lazy("shardwire.torch.peerparts")


def _plan(state: dict) -> object:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mappings = flatten_state_dict(state)
    plan = default_planner.create_default_local_save_plan(flat, is_coordinator=True)
    return plan.__class__(items=plan.items, planner_data=mappings)


def _part(owner: int, state: dict, checkpoint: str = "c", seq: int = 1, world: int = 1):
    plan = _plan(state)
    places = [pp.Where(owner, 4 * i, 4) for i in range(len(plan.items))]
    data = np.arange(4 * len(plan.items), dtype=np.uint8)
    layout = pp.PartLayout(owner, plan.items, places, plan.planner_data)
    return pp.Part(checkpoint, seq, world, layout, data, pp.digest(data))


def _state() -> dict:
    """A model's tensors and extra state (made in the test: torch is imported then)."""
    return {
        "model": {"w": torch.ones(3, 2, dtype=torch.bfloat16), "b": torch.zeros(2)},
        "extra": {"step": 7, "rng": torch.get_rng_state()},
    }


def test_a_part_s_description_comes_back_as_it_was():
    part = _part(2, _state(), world=4)
    again = pp.rebuild(pp.describe(part), part.data)
    assert again.layout == part.layout  # every item: index, type, chunk, properties
    assert (again.checkpoint, again.seq, again.world, again.digest) == ("c", 1, 4, part.digest)
    kinds = {i.index.fqn: i.type for i in again.layout.items}
    assert kinds["extra.step"] == planner.WriteItemType.BYTE_IO
    assert again.layout.planner_data["model.w"] == ("model", "w")


def test_a_description_with_other_bytes_or_types_is_refused():
    part = _part(0, _state())
    with pytest.raises(InvalidArgument, match="expected 16 bytes, got 3"):
        pp.rebuild(pp.describe(part), part.data[:3])
    described = pp.describe(part)
    tensor_item = next(i for i in described["items"] if i[5] is not None)
    tensor_item[5][2] = "torch.cuda"  # a module, not a dtype
    with pytest.raises(InvalidArgument, match="not a torch"):
        pp.rebuild(described, part.data)


def test_the_metadata_is_dcp_s_own():
    plan = _plan(_state())
    _, expected = default_planner.create_default_global_save_plan([plan], rewrite_index_hints=False)
    got = pp.metadata([_part(0, _state()).layout])
    assert got.state_dict_metadata == expected.state_dict_metadata
    assert got.planner_data == plan.planner_data
    assert {i.fqn for i in got.storage_data} == {"model.w", "model.b", "extra.step", "extra.rng"}


@pytest.mark.parametrize("to_lowest_rank", [False, True])
def test_every_rank_plans_the_save_as_dcp_s_coordinator_would(to_lowest_rank: bool):
    """Replicated items (every rank's) and a rank's own: the final plans each rank
    computes from the exchanged local plans are DCP's default planner's, item for item
    (which rank writes a replicated tensor, and the rewritten index hints)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    shared = {"model": {"w": torch.ones(64, 8), "b": torch.zeros(8), "v": torch.ones(300)}}
    local = [_plan({**shared, "own": {f"r{r}": torch.ones(r + 1)}}) for r in range(3)]
    wire = [pp.decode_plan(pp.encode_plan(p)) for p in local]
    assert [w.items for w in wire] == [p.items for p in local]
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=to_lowest_rank)
    expected, _ = planner.create_global_plan(local)
    got = pp.final_plans(wire, to_lowest_rank=to_lowest_rank)
    assert [g.items for g in got] == [e.items for e in expected]
    writers = {i.index.fqn: r for r, g in enumerate(got) for i in g.items}
    assert writers["own.r2"] == 2 and len(writers) == 6  # each item written once
    if to_lowest_rank:
        assert {writers[f"model.{k}"] for k in "wbv"} == {0}
    else:
        assert len({writers[f"model.{k}"] for k in "wbv"}) > 1  # spread over the ranks


def test_a_damaged_part_is_not_offered():
    part = _part(0, _state())
    assert pp.holdings([part]) == [["c", 1, 0, 1]]
    part.data[1] ^= 1
    assert not part.intact() and pp.holdings([part]) == []


def _held(*rows: tuple[str, int, int, int, int]) -> list[pp.Held]:
    return [pp.Held(*r) for r in rows]


def test_the_newest_whole_checkpoint_wins_and_a_part_missing_everywhere_loses():
    held = _held(
        ("a", 1, 0, 2, 0),
        ("a", 1, 1, 2, 1),  # whole
        ("b", 2, 0, 2, 0),
        ("b", 2, 1, 2, 0),  # whole, both parts on rank 0
        ("c", 3, 0, 2, 1),  # rank 1's part of c is nowhere
    )
    assert pp.whole(held) == ["b", "a"]
    assert pp.missing(held, "c") == [1] and pp.missing(held, "b") == []


def test_each_rank_serves_itself_first_else_the_lowest_holder():
    held = _held(("a", 1, 0, 3, 2), ("a", 1, 0, 3, 1), ("a", 1, 1, 3, 1), ("a", 1, 2, 3, 2))
    assert pp.servers(held, "a", me=0) == {0: 1, 1: 1, 2: 2}
    assert pp.servers(held, "a", me=2) == {0: 2, 1: 1, 2: 2}
    assert pp.assigned(held, "a") == {0: 1, 1: 1, 2: 2}


def test_gathered_holdings_name_their_server():
    assert pp.gathered([[["a", 1, 0, 2]], [], [["a", 1, 1, 2]]]) == _held(
        ("a", 1, 0, 2, 0), ("a", 1, 1, 2, 2)
    )


CASES = [
    "bad input before any save",
    "FSDP2 -> DDP",
    "DDP -> FSDP2",
    "async save",
    "keep",
    "an id no rank holds",
    "another model shape",
    "damage",
    "one rank's entry",
]


@pytest.mark.slow
@pytest.mark.e2e
def test_every_case_on_four_ranks(tmp_path):
    ranks = run_ranks(4, "peerstore.py", tmp=tmp_path)
    assert ranks.codes == [0, 0, 0, 0], [e[-3000:] for e in ranks.errs]
    for out in ranks.outs:
        assert [line for line in out.splitlines() if line.startswith("ok ")] == [
            f"ok {case}" for case in CASES
        ]
