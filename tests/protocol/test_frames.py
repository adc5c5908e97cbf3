"""Frame decoder: round trips, zero-copy destinations and every limit, checked early."""

from __future__ import annotations

import itertools
import struct
import tracemalloc
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwire.protocol import (
    HANDSHAKE_LIMITS,
    SMALL_STAGE,
    FrameDecoder,
    FrameKind,
    FrameTooLarge,
    Header,
    Limits,
    ProtocolError,
    VersionMismatch,
    encode_head,
)
from shardwire.protocol.decoder import STAGE_BYTES, StagePool
from shardwire.protocol.frames import (
    MAGIC,
    MAX_META_BYTES,
    PREFIX,
    PREFIX_SIZE,
    PROTOCOL_VERSION,
    Frame,
)


def data_frame(payload: bytes, **meta) -> bytes:
    return encode_head(FrameKind.DATA, {"op": "x", **meta}, len(payload)) + payload


def test_round_trip_in_one_chunk() -> None:
    wire = data_frame(b"abcdef", seq=3) + encode_head(FrameKind.CONTROL, {"kind": "leave"})
    frames = FrameDecoder().feed(wire)
    assert [f.kind for f in frames] == [FrameKind.DATA, FrameKind.CONTROL]
    assert frames[0].meta == {"op": "x", "seq": 3}
    assert bytes(frames[0].payload) == b"abcdef"
    assert frames[1].meta == {"kind": "leave"}


def test_one_byte_at_a_time() -> None:
    wire = b"".join(data_frame(bytes([i]) * i, i=i) for i in range(6))
    decoder = FrameDecoder()
    frames = []
    for byte in wire:
        frames += decoder.feed(bytes([byte]))
    assert [f.meta["i"] for f in frames] == list(range(6))
    assert [bytes(f.payload) for f in frames] == [bytes([i]) * i for i in range(6)]
    assert not decoder.mid_frame


def test_payload_lands_in_the_allocators_buffer() -> None:
    dest = np.zeros(4, np.float64)
    seen: list[Header] = []

    def allocate(header: Header) -> memoryview:
        seen.append(header)
        return memoryview(dest.view(np.uint8))

    src = np.array([1.5, 2.5, 3.5, 4.5])
    decoder = FrameDecoder(allocator=allocate)
    wire = encode_head(FrameKind.DATA, {"op": "x"}, src.nbytes) + src.tobytes()
    # Drive it like asyncio.BufferedProtocol: write into get_buffer(), report the count.
    frames, pos = [], 0
    while pos < len(wire):
        buf = decoder.get_buffer()
        n = min(len(buf), 7, len(wire) - pos)
        buf[:n] = wire[pos : pos + n]
        pos += n
        decoder.buffer_updated(n)
        while (frame := decoder.next_frame()) is not None:
            frames.append(frame)
    assert seen[0].payload_len == 32 and seen[0].meta == {"op": "x"}
    np.testing.assert_array_equal(dest, src)
    assert np.shares_memory(np.frombuffer(frames[0].payload, np.uint8), dest)


def _prefix(*, magic=MAGIC, version=PROTOCOL_VERSION, kind=2, meta_len=2, payload_len=0):
    return PREFIX.pack(magic, version, kind, meta_len, payload_len)


def test_huge_length_prefix_is_refused_before_allocating() -> None:
    prefix = _prefix(payload_len=2**63)
    decoder = FrameDecoder()  # its staging buffer is allocated here, not per frame
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        with pytest.raises(FrameTooLarge, match="payload length 9223372036854775808"):
            decoder.feed(prefix)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename") if s.size_diff > 0)
    assert grown < 64 * 1024


def test_meta_limit_is_checked_from_the_prefix() -> None:
    with pytest.raises(FrameTooLarge, match="meta length 70000 exceeds limit 65536"):
        FrameDecoder().feed(_prefix(meta_len=70000))


def test_configured_payload_limit() -> None:
    with pytest.raises(FrameTooLarge, match="exceeds limit 100"):
        FrameDecoder(limits=Limits(max_payload=100)).feed(_prefix(payload_len=101))


@pytest.mark.parametrize(
    ("prefix", "error", "text"),
    [
        (_prefix(magic=b"XX"), ProtocolError, "bad frame magic"),
        (_prefix(version=PROTOCOL_VERSION + 1), VersionMismatch, "protocol version mismatch"),
        (_prefix(kind=9), ProtocolError, "unknown frame kind 9"),
        (_prefix(kind=1, payload_len=8), ProtocolError, "CONTROL frame carries 8"),
    ],
)
def test_bad_prefixes(prefix: bytes, error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        FrameDecoder().feed(prefix)


def test_meta_must_be_a_string_keyed_map_without_ext_types() -> None:
    import msgpack

    for meta in (
        msgpack.packb([1, 2]),
        msgpack.packb({1: 2}),
        msgpack.packb(msgpack.ExtType(5, b"x")),
    ):
        wire = struct.pack(">2sBBIQ", MAGIC, PROTOCOL_VERSION, 1, len(meta), 0) + meta
        with pytest.raises(ProtocolError):
            FrameDecoder().feed(wire)


def test_decoder_stays_broken_after_a_violation() -> None:
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError):
        decoder.feed(_prefix(magic=b"XX"))
    with pytest.raises(ProtocolError, match="broken"):
        decoder.feed(b"more")


_DATA = data_frame(b"\x01\x02\x03\x04", seq=1)
_CONTROL = encode_head(FrameKind.CONTROL, {"kind": "leave"})
_VALID = _DATA + _CONTROL
_SENT = [
    (FrameKind.DATA, {"op": "x", "seq": 1}, b"\x01\x02\x03\x04"),
    (FrameKind.CONTROL, {"kind": "leave"}, b""),
]
_SPANS = [(0, len(_DATA), 4), (len(_DATA), len(_VALID), 0)]  # start, end, payload bytes
_FUZZ_LIMITS = Limits(max_payload=1 << 20)


def _fuzz_decoder() -> FrameDecoder:
    return FrameDecoder(limits=_FUZZ_LIMITS, stage_bytes=SMALL_STAGE)


def _refusal(prefix: bytes) -> tuple[type[ProtocolError], str] | None:
    """The error the format (the table in ``protocol.frames``) refuses a whole prefix
    with, written out here apart from ``parse_prefix``; None if the prefix is valid."""
    magic, version, kind, meta_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        return ProtocolError, "bad frame magic"
    if version != PROTOCOL_VERSION:
        return VersionMismatch, "protocol version mismatch"
    if kind not in (1, 2, 3):
        return ProtocolError, f"unknown frame kind {kind}"
    if meta_len > _FUZZ_LIMITS.max_meta or payload_len > _FUZZ_LIMITS.max_payload:
        return FrameTooLarge, "exceeds limit"
    if kind != FrameKind.DATA and payload_len:
        return ProtocolError, "frame carries"
    return None


def _received(frames: list[Frame]) -> list[tuple[FrameKind, dict, bytes]]:
    return [(f.kind, f.meta, bytes(f.payload)) for f in frames]


def test_random_bytes_are_refused_by_their_prefix() -> None:
    seen: Counter[str] = Counter()

    tail = st.binary(min_size=PREFIX_SIZE, max_size=512)
    valid_prefix = st.builds(
        lambda kind, meta_len, payload_len: _prefix(
            kind=kind, meta_len=meta_len, payload_len=payload_len * (kind == FrameKind.DATA)
        ),
        st.sampled_from(list(FrameKind)),
        st.integers(0, 64),
        st.integers(0, 64),
    )

    @settings(max_examples=400, deadline=None, derandomize=True, database=None)
    @given(
        st.one_of(
            st.binary(max_size=PREFIX_SIZE - 1),
            tail,
            tail.map(lambda b: MAGIC + b),
            tail.map(lambda b: MAGIC + bytes([PROTOCOL_VERSION]) + b),
            st.tuples(valid_prefix, tail).map(b"".join),
        )
    )
    def check(blob: bytes) -> None:
        decoder = _fuzz_decoder()
        if len(blob) < PREFIX_SIZE:  # no prefix to judge yet
            assert decoder.feed(blob) == [] and decoder.mid_frame == bool(blob)
            seen["short"] += 1
            return
        refusal = _refusal(blob[:PREFIX_SIZE])
        if refusal is not None:
            with pytest.raises(refusal[0], match=refusal[1]):
                decoder.feed(blob)
            seen["refused"] += 1
            return
        try:  # a valid prefix: the meta decoder judges what follows
            decoder.feed(blob)
        except ProtocolError:
            seen["refused by the meta"] += 1
        else:
            seen["accepted"] += 1

    check()
    assert seen["refused"] >= 100, seen  # most long inputs: bad magic, version or kind
    assert min(seen[k] for k in ("short", "refused by the meta", "accepted")) > 0, seen


def _flip_verdict(byte: int, mask: int, cut: int) -> tuple[type[ProtocolError], str] | str:
    """What the decoder must make of ``_VALID`` with ``byte`` XOR ``mask``, cut after
    ``cut`` bytes: a refusal; "unharmed" when the flipped part (prefix, meta or payload)
    of its frame is not complete, as the decoder judges a part only once it has all of
    it; "payload" for a flipped payload bit (without a checksum it arrives as flipped);
    "open" for a flipped meta byte or a length still within the limits (msgpack and
    the bytes that follow decide)."""
    if byte >= cut:
        return "unharmed"
    start, end, payload = next(span for span in _SPANS if span[0] <= byte < span[1])
    offset, meta_end = byte - start, end - payload
    if offset < PREFIX_SIZE:
        part_end = start + PREFIX_SIZE
    else:
        part_end = meta_end if byte < meta_end else end
    if cut < part_end:
        return "unharmed"
    if offset < PREFIX_SIZE:
        prefix = bytearray(_VALID[start : start + PREFIX_SIZE])
        prefix[offset] ^= mask
        return _refusal(bytes(prefix)) or "open"
    return "payload" if byte >= meta_end else "open"


def test_bit_flips_are_refused_as_the_format_says_and_cut_frames_are_awaited() -> None:
    seen: Counter[str] = Counter()
    refused_whole: set[tuple[int, int]] = set()
    ends = [end for _, end, _ in _SPANS]
    for byte, bit, cut in itertools.product(range(len(_VALID)), range(8), range(len(_VALID) + 1)):
        wire = bytearray(_VALID)
        wire[byte] ^= 1 << bit
        verdict = _flip_verdict(byte, 1 << bit, cut)
        decoder = _fuzz_decoder()
        if isinstance(verdict, tuple):
            with pytest.raises(verdict[0], match=verdict[1]):
                decoder.feed(bytes(wire[:cut]))
            seen["refused"] += 1
            if cut == len(_VALID):
                refused_whole.add((byte, bit))
            continue
        whole = [sent for sent, (_, end, _) in zip(_SENT, _SPANS, strict=True) if end <= cut]
        if verdict == "open":
            before = sum(end <= byte for end in ends)  # frames ahead of the damaged one
            try:
                got = _received(decoder.feed(bytes(wire[:cut])))
            except ProtocolError:
                seen["open: refused"] += 1
            else:
                assert got[:before] == whole[:before], (byte, bit, cut)
                seen["open: accepted"] += 1
            continue
        if verdict == "payload":
            whole[0] = (FrameKind.DATA, _SENT[0][1], bytes(wire[len(_DATA) - 4 : len(_DATA)]))
        assert _received(decoder.feed(bytes(wire[:cut]))) == whole, (byte, bit, cut, verdict)
        assert decoder.mid_frame == (cut not in (0, *ends)), (byte, bit, cut)
        seen[verdict] += 1
    # Flips in magic and version refuse either frame, and so does every flip of the data
    # frame's kind (no other kind carries a payload) and all but one of the control
    # frame's (1 -> 3 is a well-formed handshake frame).
    for start, _, _ in _SPANS:
        assert {(start + b, bit) for b in range(3) for bit in range(8)} <= refused_whole
    assert {(3, bit) for bit in range(8)} <= refused_whole
    control_kind = {bit for byte, bit in refused_whole if byte == len(_DATA) + 3}
    assert control_kind == {0, 2, 3, 4, 5, 6, 7}
    assert min(seen[v] for v in ("unharmed", "payload", "open: accepted", "open: refused")) > 0
    assert seen["refused"] >= 2 * 24 + 8 + 7, seen


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
def test_oversized_lengths_are_refused_without_buffering(meta_len: int, payload_len: int) -> None:
    decoder = FrameDecoder(limits=_FUZZ_LIMITS)
    prefix = _prefix(meta_len=meta_len, payload_len=payload_len)
    if meta_len > MAX_META_BYTES or payload_len > 1 << 20:
        with pytest.raises(FrameTooLarge, match="exceeds limit"):
            decoder.feed(prefix)
    elif meta_len == 0:  # complete at once, and no bytes are no map
        with pytest.raises(ProtocolError, match="undecodable meta map"):
            decoder.feed(prefix)
    else:
        assert decoder.feed(prefix) == [] and decoder.mid_frame


def test_frames_are_handed_over_before_the_next_header_is_parsed() -> None:
    # A handshake's last message and the first data frame often arrive in one read: the
    # data frame's destination must only be chosen after the handshake frame is handled.
    events: list[str] = []

    def allocate(header: Header) -> memoryview:
        events.append(f"allocate {header.meta['n']}")
        return memoryview(bytearray(header.payload_len))

    decoder = FrameDecoder(allocator=allocate)
    wire = encode_head(FrameKind.HANDSHAKE, {"n": 0}) + data_frame(b"xy", n=1)
    wire += data_frame(b"z", n=2)
    buf = decoder.get_buffer()
    buf[: len(wire)] = wire
    decoder.buffer_updated(len(wire))
    while (frame := decoder.next_frame()) is not None:
        events.append(f"frame {frame.meta['n']}")
    assert events == ["frame 0", "allocate 1", "frame 1", "allocate 2", "frame 2"]


def test_deferred_destination_is_resumed_later() -> None:
    decoder = FrameDecoder(allocator=lambda header: None)
    decoder.feed(data_frame(b"abcd", n=1)[:-1])
    assert decoder.waiting and decoder.next_frame() is None
    target = memoryview(bytearray(4))
    decoder.resume(target)
    assert decoder.next_frame() is None  # one byte still missing
    decoder.buffer_updated(0)
    buf = decoder.get_buffer()
    buf[:1] = b"d"
    decoder.buffer_updated(1)
    frame = decoder.next_frame()
    assert frame is not None and bytes(frame.payload) == b"abcd" and frame.payload is target


def test_a_small_stage_grows_only_as_far_as_a_frame_within_the_limits_needs() -> None:
    decoder = FrameDecoder(limits=HANDSHAKE_LIMITS, stage_bytes=SMALL_STAGE)
    assert decoder.stage_bytes == SMALL_STAGE
    small = encode_head(FrameKind.CONTROL, {"kind": "hello", "pad": "x" * 100})
    assert len(decoder.feed(small * 20)) == 20  # many small frames, no growth
    assert decoder.stage_bytes == SMALL_STAGE
    big = encode_head(FrameKind.CONTROL, {"kind": "hello", "pad": "y" * 12000})
    frames = decoder.feed(big[:7000]) + decoder.feed(big[7000:])
    assert frames[0].meta["pad"] == "y" * 12000
    assert SMALL_STAGE < decoder.stage_bytes < 2 * HANDSHAKE_LIMITS.max_meta
    with pytest.raises(FrameTooLarge, match="exceeds limit 16384"):
        decoder.feed(encode_head(FrameKind.CONTROL, {"pad": "z" * 20000}))


def test_handshake_limits_refuse_data_frames_until_upgraded() -> None:
    payload = np.arange(4, dtype=np.float32).tobytes()
    with pytest.raises(FrameTooLarge, match="payload length 16 exceeds limit 0"):
        FrameDecoder(limits=HANDSHAKE_LIMITS, stage_bytes=SMALL_STAGE).feed(data_frame(payload))
    decoder = FrameDecoder(limits=HANDSHAKE_LIMITS, stage_bytes=SMALL_STAGE)
    hello = encode_head(FrameKind.HANDSHAKE, {"kind": "hello"})
    wire = hello + data_frame(payload)
    first = decoder.feed(wire[: len(hello) + 5])  # part of the data prefix is staged
    decoder.upgrade(Limits(), stage_bytes=STAGE_BYTES)
    rest = decoder.feed(wire[len(hello) + 5 :])
    assert [f.kind for f in first + rest] == [FrameKind.HANDSHAKE, FrameKind.DATA]
    assert bytes(rest[0].payload) == payload
    assert decoder.stage_bytes == STAGE_BYTES


def test_a_pooled_decoder_borrows_a_stage_per_burst_and_gives_it_back_when_parsed() -> None:
    pool = StagePool()
    decoder = FrameDecoder(limits=HANDSHAKE_LIMITS, stage_bytes=SMALL_STAGE)
    decoder.upgrade(Limits(), pool=pool)
    payloads = [np.full(1000 + i, i, np.uint8).tobytes() for i in range(100)]
    got = decoder.feed(b"".join(data_frame(p) for p in payloads))
    assert [bytes(f.payload) for f in got] == payloads
    assert not decoder.borrowing and pool.lent == 0
    assert decoder.stage_bytes == SMALL_STAGE  # what an idle connection keeps


def test_a_frame_split_anywhere_keeps_its_borrowed_stage_until_parsed() -> None:
    pool = StagePool()
    wire = data_frame(np.arange(300, dtype=np.float64).tobytes()) + data_frame(b"tail")
    for cut in range(1, len(wire)):
        decoder = FrameDecoder()
        decoder.upgrade(Limits(), pool=pool)
        first = decoder.feed(wire[:cut])
        assert decoder.borrowing == (pool.lent == 1)
        rest = decoder.feed(wire[cut:])
        assert [bytes(f.payload)[-4:] for f in first + rest][-1] == b"tail"
        assert pool.lent == 0 and not decoder.borrowing


def test_decoders_reading_at_once_never_share_a_stage() -> None:
    pool = StagePool(keep=1)
    one, two = FrameDecoder(), FrameDecoder()
    for decoder in (one, two):
        decoder.upgrade(Limits(), pool=pool)
    a, b = data_frame(b"a" * 5000), data_frame(b"b" * 5000)
    assert one.feed(a[:10]) == [] and two.feed(b[:10]) == []  # both hold a partial prefix
    assert pool.lent == 2 and one.borrowing and two.borrowing
    assert one.feed(a[10:100]) == []  # payload bytes go to the frame's own buffer: drained
    assert pool.lent == 1 and not one.borrowing
    assert bytes(one.feed(a[100:])[0].payload) == b"a" * 5000
    assert bytes(two.feed(b[10:])[0].payload) == b"b" * 5000
    assert pool.lent == 0
