"""Control messages: round trips, the type registry, and a decoder that nothing can crash."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.control import VALID, assert_dropped_cleanly, packed, plain, wire_of
from support.monitors import stage_record
from vpipe.control import messages
from vpipe.control.messages import DecodeError, Decoder, decode, encode, make, register_type


@pytest.mark.parametrize("message", VALID, ids=lambda m: m.type)
def test_every_builtin_type_round_trips(message):
    assert decode(encode(message)) == message


def test_envelope_on_the_wire_has_the_documented_fields():
    wire = wire_of(make("ping", epoch=5, iteration=7, stage=2))
    assert wire == {"v": 1, "type": "ping", "epoch": 5, "iter": 7, "stage": 2, "src": 2, "body": None}


@pytest.mark.parametrize("change, reason", [
    ({"v": 2}, "bad_version"),
    ({"v": True}, "bad_version"),
    ({"type": "teleport"}, "unknown_type"),
    ({"type": 7}, "unknown_type"),
    ({"epoch": -1}, "bad_field"),
    ({"iter": -2}, "bad_field"),
    ({"stage": 1 << 20}, "bad_field"),
    ({"src": "3"}, "bad_field"),
    ({"body": {"x": 1}}, "bad_body"),
    ({"extra": 1}, "bad_envelope"),
])
def test_bad_envelopes_are_rejected_with_their_reason(change, reason):
    wire = wire_of(make("ping", stage=1))
    wire.update(change)
    with pytest.raises(DecodeError) as err:
        decode(packed(wire))
    assert err.value.reason == reason


@pytest.mark.parametrize("data, reason", [
    (b"", "empty"),
    (b"\xc1", "not_msgpack"),
    (packed([1, 2, 3]), "not_a_map"),
    (packed({1: 2}), "not_msgpack"),  # strict_map_key: only string keys
    (b"\xdd\xff\xff\xff\xff", "not_msgpack"),  # an array header claiming 4 billion items
    (b"\xdb\xff\xff\xff\xf0abc", "not_msgpack"),  # a string header claiming 4 GiB
    (b"\x91" * 100_000 + b"\xc0", "not_msgpack"),  # nesting deeper than the unpacker's stack
    (b"\xd6\xff\x00\x00\x00\x01", "not_a_map"),  # a msgpack timestamp, not a map
    (b"\xc7\x01\x05x", "ext_type"),  # an application extension type
    ("text", "not_bytes"),
])
def test_malformed_frames_are_rejected_with_their_reason(data, reason):
    with pytest.raises(DecodeError) as err:
        decode(data)
    assert err.value.reason == reason


def test_size_cap_applies_on_both_sides():
    big = make("bye", "x" * 900, stage=0)
    with pytest.raises(ValueError, match="over the 500-byte cap"):
        encode(big, max_bytes=500)
    with pytest.raises(DecodeError) as err:
        decode(encode(big), max_bytes=500)
    assert err.value.reason == "too_large"


def test_stats_vector_body_is_validated_record_by_record():
    wire = wire_of(VALID[0])
    wire["body"]["records"][1]["layers"][0]["fwd_s"] = -1.0
    with pytest.raises(DecodeError, match="fwd_s must be a finite number"):
        decode(packed(wire))
    wire["body"]["records"] = []
    with pytest.raises(DecodeError, match="1-1024 stage records"):
        decode(packed(wire))


def test_other_parts_register_their_own_types():
    def parse_prepare(body):
        if not isinstance(body, dict) or not isinstance(body.get("layer"), int):
            raise ValueError("migrate_prepare needs an integer layer")
        return body["layer"]

    register_type("test_migrate_prepare", parse_prepare, lambda layer: {"layer": layer})
    try:
        message = make("test_migrate_prepare", 7, epoch=4, stage=1)
        assert decode(encode(message)).body == 7
        assert "test_migrate_prepare" in messages.registered_types()
        with pytest.raises(ValueError, match="already registered"):
            register_type("test_migrate_prepare", parse_prepare)
        wire = wire_of(message)
        wire["body"] = {"layer": "seven"}
        with pytest.raises(DecodeError, match="needs an integer layer"):
            decode(packed(wire))
    finally:
        messages._REGISTRY.pop("test_migrate_prepare", None)
    with pytest.raises(ValueError, match="unknown message type"):
        encode(make("test_migrate_prepare", 7))
    with pytest.raises(ValueError, match="1-64 characters"):
        register_type("", parse_prepare)


def test_a_crashing_parser_is_a_dropped_message_not_a_crash():
    register_type("test_buggy", lambda body: body["missing"])
    try:
        with pytest.raises(DecodeError) as err:
            decode(encode(make("test_buggy", {})))
        assert err.value.reason == "bad_body"
    finally:
        messages._REGISTRY.pop("test_buggy", None)


def test_decoder_counts_logs_and_then_rate_limits(caplog):
    decoder = Decoder(name="test inbox", log_first=3, log_every=5)
    with caplog.at_level(logging.WARNING, logger="vpipe.control"):
        for _ in range(10):
            assert decoder.accept(b"\xc1") is None
        assert decoder.accept(encode(VALID[-1])) == VALID[-1]
    assert decoder.dropped == {"not_msgpack": 10}
    assert decoder.total_dropped == 10
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 + 2  # the first three, then one line per five
    assert "test inbox: dropped a bad control message (not_msgpack" in lines[0]
    assert "10 bad control messages dropped for not_msgpack" in lines[-1]


# ---------------------------------------------------------------- fuzzing
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])






@FUZZ
@given(data=st.binary(max_size=300))
def test_fuzz_random_bytes(data):
    assert_dropped_cleanly(data)


@FUZZ
@given(index=st.integers(0, len(VALID) - 1), cut=st.integers(0, 10_000))
def test_fuzz_truncated_messages(index, cut):
    data = encode(VALID[index])
    assert_dropped_cleanly(data[: cut % len(data)])


@FUZZ
@given(index=st.integers(0, len(VALID) - 1),
       key=st.sampled_from(["v", "type", "epoch", "iter", "stage", "src", "body"]), value=plain)
def test_fuzz_wrong_types_in_the_envelope(index, key, value):
    wire = wire_of(VALID[index])
    wire[key] = value
    assert_dropped_cleanly(packed(wire))


@FUZZ
@given(record=st.integers(0, 1), field=st.sampled_from(sorted(stage_record().to_wire())), value=plain)
def test_fuzz_wrong_types_inside_stats_records(record, field, value):
    wire = wire_of(VALID[0])
    wire["body"]["records"][record][field] = value
    assert_dropped_cleanly(packed(wire))


@FUZZ
@given(header=st.sampled_from([b"\xdc", b"\xdd", b"\xde", b"\xdf", b"\xda", b"\xdb", b"\xc5", b"\xc6",
                               b"\xc9"]),
       length=st.integers(0, (1 << 32) - 1), tail=st.binary(max_size=40))
def test_fuzz_huge_length_headers(header, length, tail):
    size = 2 if header in (b"\xdc", b"\xde", b"\xda", b"\xc5") else 4
    data = header + (length % (1 << (8 * size))).to_bytes(size, "big") + tail
    assert_dropped_cleanly(data)
    assert_dropped_cleanly(b"\x81\xa4body" + data)
