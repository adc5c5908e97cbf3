"""``shardwire.torch.heal``: a replicated state from a live rank. Its pure core in one
process (the tree's wire form, who sends), and every case a user meets on 3 real ranks
over shardwire's backend and over gloo (it uses only ``torch.distributed``)."""

from __future__ import annotations

import pytest

from shardwire.protocol import InvalidType

from .lazy import Lazy, skip_without_torch
from .spawn import run_ranks

skip_without_torch()
torch = Lazy("torch")
hl = Lazy("shardwire.torch.livestate")

CASES = [
    "nothing anywhere",
    "a replacement",
    "one step behind",
    "all alike",
    "every leaf kind",
    "a shard",
]


def _round_trip(state):
    structure, table = hl.encode(state)
    return hl.decode(structure, hl._bytes_of(table))


def test_a_tree_comes_back_as_it_was_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    state = {
        "flag": torch.tensor([True, False, True]),  # 3 bytes: the next tensor is aligned
        "w": torch.randn(3, 5, generator=g),
        "half": torch.randn(7, generator=g).to(torch.bfloat16),
        "wave": torch.randn(2, generator=g, dtype=torch.complex128),
        "empty": torch.empty(0, 2, dtype=torch.int32),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "betas": (0.9, 0.999),
        "groups": [{"lr": 0.01, "params": [0, 1], "name": "x", "foreach": None}],
        "by_index": {3: torch.ones(2), 11: "eleven"},
        "step": 12,
        "done": True,
    }
    back = _round_trip(state)
    assert back.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert back[key].dtype == value.dtype and back[key].shape == value.shape
            assert torch.equal(back[key], value), key
        elif key == "by_index":
            assert torch.equal(back[key][3], value[3]) and back[key][11] == "eleven"
        else:
            assert back[key] == value and type(back[key]) is type(value), key


def test_the_lowest_rank_of_the_newest_step_sends():
    assert hl.choose([4, 5, 5]) == hl.Sender(rank=1, step=5)
    assert hl.choose([-1, 3, -1]) == hl.Sender(rank=1, step=3)
    assert hl.choose([-1, -1]).step == -1


def _dict_keys():
    return {1.5: torch.ones(1)}.keys()


# made in the test: torch is imported by the first test that needs it
@pytest.mark.parametrize("leaf", [object, bytes, _dict_keys], ids=["object", "bytes", "keys"])
def test_a_leaf_heal_does_not_send_is_named(leaf):
    with pytest.raises(InvalidType, match=r"state\.model\.odd"):
        hl.encode({"model": {"odd": leaf()}})


def test_a_dtype_heal_does_not_send_is_named():
    with pytest.raises(InvalidType, match="uint16"):
        hl.encode({"counts": torch.zeros(2, dtype=torch.uint16)})


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["shardwire", "gloo"])
def test_every_case_on_three_ranks(tmp_path, backend):
    ranks = run_ranks(3, "heal.py", backend, tmp=tmp_path)
    assert ranks.codes == [0, 0, 0], [e[-3000:] for e in ranks.errs]
    for out in ranks.outs:
        assert [line for line in out.splitlines() if line.startswith("ok ")] == [
            f"ok {case}" for case in CASES
        ]
