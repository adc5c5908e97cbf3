"""Tensor meta validation and the control-message union."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from shardwire.protocol import (
    ProtocolError,
    Tag,
    TensorMeta,
    check_dtype,
    parse_tensor_meta,
    tensors,
)
from shardwire.protocol.codec import unpack_meta
from shardwire.protocol.messages import Abort, Join, decode_message, encode_message
from shardwire.protocol.placement import PEER_PAGE, PeerQuery
from shardwire.protocol.tensors import ALLOWED_DTYPES


def test_tensor_meta_round_trip() -> None:
    arr = np.zeros((3, 5), np.float32)
    meta = TensorMeta.for_array(arr, src=2, tag=Tag(1, 17, 3), op="all_gather", generation=4)
    parsed = parse_tensor_meta(meta.to_wire(), arr.nbytes)
    assert parsed == meta


@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype("O"),
        np.dtype(">f8"),
        np.dtype([("a", "i4")]),
        np.dtype("complex64"),
        np.dtype("U3"),
    ],
)
def test_dtype_allowlist(dtype: np.dtype) -> None:
    with pytest.raises(ProtocolError, match="not allowed"):
        check_dtype(dtype)


def test_size_must_match_dtype_and_shape() -> None:
    wire = TensorMeta(1, Tag(0, 17), "all_gather", "float32", (4,)).to_wire()
    with pytest.raises(
        ProtocolError, match=r"rank 1 for all_gather #17: .* needs 16 bytes, frame announces 20"
    ):
        parse_tensor_meta(wire, 20)


@pytest.mark.parametrize(("seq", "step"), [(0, 0), (1, 127), (128, 1 << 30), (1 << 33, 255)])
def test_packed_meta_is_the_msgpack_map_of_its_fields(seq: int, step: int) -> None:
    meta = TensorMeta(3, Tag(123456789, seq, step), "all_reduce:float32:6:sum", "float32", (2, 3))
    for extra in [(), (("ck", 1),), (("shm", 1),)]:
        for _ in range(2):  # packed, then from the cached bytes
            packed = tensors.pack_tensor_meta(meta, extra)
            assert unpack_meta(packed) == {**meta.to_wire(), **dict(extra)}
    assert parse_tensor_meta(unpack_meta(packed), None) == meta


def test_packed_meta_cache_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(tensors, "_BODIES", {})
    monkeypatch.setattr(tensors, "_MAX_BODIES", 8)
    for shape in range(20):
        meta = TensorMeta(0, Tag(0, 1), "x", "uint8", (shape,))
        assert unpack_meta(tensors.pack_tensor_meta(meta))["shape"] == [shape]
        assert len(tensors._BODIES) <= 8


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "object"),
        ("dtype", ["float32"]),
        ("shape", [-1]),
        ("shape", "4"),
        ("shape", [2, "2"]),
        ("shape", [True, 4]),
        ("seq", -1),
        ("seq", True),
        ("src", "0"),
        ("gen", 1.0),
        ("op", 3),
        ("op", "x" * 300),
    ],
)
def test_hostile_tensor_meta_is_rejected(field: str, value: object) -> None:
    wire = TensorMeta(0, Tag(0, 1), "x", "uint8", (4,)).to_wire()
    wire[field] = value
    with pytest.raises(ProtocolError):
        parse_tensor_meta(wire, 4)


@pytest.mark.parametrize("field", ["src", "group", "seq", "step", "op", "dtype", "shape", "gen"])
def test_a_missing_field_is_named(field: str) -> None:
    wire = TensorMeta(0, Tag(0, 1), "x", "uint8", (4,)).to_wire()
    del wire[field]
    with pytest.raises(ProtocolError, match=field):
        parse_tensor_meta(wire, 4)


def test_messages_round_trip_through_the_union() -> None:
    join = Join(world_size=4, node_id="n", local_rank=1, local_world_size=2, listen_port=9)
    assert decode_message(encode_message(join)) == join
    abort = Abort(rank=3, reason="died", traceback="tb")
    assert decode_message(encode_message(abort)) == abort


def test_unknown_fields_are_ignored_and_missing_ones_defaulted() -> None:
    msg = decode_message({"kind": "abort", "rank": 1, "reason": "x", "future_field": 1})
    assert msg == Abort(rank=1, reason="x")


@pytest.mark.parametrize(
    "meta",
    [
        {"kind": "nope"},
        {"kind": "join"},
        {"kind": "placement", "rank": 0, "world_size": 1, "generation": 1},  # no local rank
        {"kind": "peer_query", "ranks": []},
        {},
    ],
)
def test_invalid_messages_are_protocol_errors(meta: dict) -> None:
    with pytest.raises(ProtocolError, match="invalid control message"):
        decode_message(meta)


def test_a_peer_query_asks_for_at_most_a_page_of_ranks() -> None:
    assert PeerQuery(ranks=list(range(PEER_PAGE))).kind == "peer_query"
    with pytest.raises(ValidationError):
        PeerQuery(ranks=list(range(PEER_PAGE + 1)))


@pytest.mark.parametrize("name", sorted(ALLOWED_DTYPES))
def test_every_allowed_dtype_by_dtype_name_or_alias_and_its_size(name: str) -> None:
    dtype = np.dtype(name)
    for spec in (dtype, name, dtype.str, dtype.type, name, dtype):  # again: from the table
        assert check_dtype(spec) == name
    assert TensorMeta(0, Tag(0, 1), "x", name, (3, 2)).nbytes == 6 * dtype.itemsize


def test_a_spec_numpy_reads_as_a_structured_dtype_is_not_allowed() -> None:
    with pytest.raises(ProtocolError, match="not allowed"):
        check_dtype({"names": ["a"], "formats": ["f4"]})  # type: ignore[arg-type]
