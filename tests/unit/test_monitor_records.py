"""Stats records survive msgpack and reject what a peer could get wrong."""

from __future__ import annotations

import math

import msgpack
import pytest

from support.monitors import layer, stage_record
from vpipe.monitors.records import GPU_ONLY_FIELDS, MAX_LAYERS, LayerRecord, RecordError, StageRecord


def through_msgpack(wire):
    return msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False, strict_map_key=True)


def test_stage_record_round_trips_through_msgpack():
    record = stage_record(gpu_util_pct=55.0, pcie_rx_bytes_s=1e9, pcie_tx_bytes_s=2e9, kept_bytes_per_mb=3000)
    assert StageRecord.from_wire(through_msgpack(record.to_wire())) == record
    older = {k: v for k, v in record.to_wire().items() if k != "kept_bytes_per_mb"}  # a peer before the field
    assert StageRecord.from_wire(older).kept_bytes_per_mb == 0
    assert record.layer_ids == [3, 4]
    assert record.compute_s == pytest.approx(0.06)
    assert layer().fwd_per_call_s == pytest.approx(0.0025)
    assert layer(bwd_calls=0, bwd_s=0.0).bwd_per_call_s == 0.0


def test_gpu_only_fields_may_be_null_but_nothing_else():
    wire = stage_record().to_wire()
    for name in GPU_ONLY_FIELDS:
        assert wire[name] is None
    StageRecord.from_wire(wire)
    for name in ("step_s", "device_peak_bytes", "recompute_s"):
        with pytest.raises(RecordError, match=name):
            StageRecord.from_wire(dict(wire, **{name: None}))


@pytest.mark.parametrize("name, value, message", [
    ("stage", -1, "stage must be an integer"),
    ("iteration", True, "iteration must be an integer"),
    ("step_s", math.nan, "step_s must be a finite number"),
    ("step_s", -0.5, "step_s must be a finite number"),
    ("d2h_bytes", 1.5, "d2h_bytes must be an integer"),
    ("device", "x" * 65, "device must be a string"),
    ("gpu_util_pct", "high", "gpu_util_pct must be a finite number"),
    ("layers", {"0": 1}, "layers must be a list"),
    ("kept_bytes_per_mb", -1, "kept_bytes_per_mb must be an integer"),
])
def test_stage_record_rejects_bad_values_naming_the_field(name, value, message):
    wire = stage_record().to_wire()
    wire[name] = value
    with pytest.raises(RecordError, match=message):
        StageRecord.from_wire(wire)


def test_records_reject_missing_unknown_and_duplicate_fields():
    wire = stage_record().to_wire()
    with pytest.raises(RecordError, match="missing step_s"):
        StageRecord.from_wire({k: v for k, v in wire.items() if k != "step_s"})
    with pytest.raises(RecordError, match="unknown fields extra"):
        StageRecord.from_wire(dict(wire, extra=1))
    with pytest.raises(RecordError, match="must be a map"):
        StageRecord.from_wire([1, 2])
    wire["layers"][1]["layer_id"] = wire["layers"][0]["layer_id"]
    with pytest.raises(RecordError, match="names a layer twice"):
        StageRecord.from_wire(wire)
    bad_layer = layer().to_wire()
    bad_layer["fwd_calls"] = -1
    with pytest.raises(RecordError, match="fwd_calls"):
        LayerRecord.from_wire(bad_layer)


def test_record_with_absurd_layer_count_is_rejected():
    wire = stage_record().to_wire()
    wire["layers"] = [layer(i).to_wire() for i in range(MAX_LAYERS + 1)]
    with pytest.raises(RecordError, match="at most"):
        StageRecord.from_wire(wire)


def test_block_kinds_and_what_a_stage_builds_travel_and_are_checked():
    rec = stage_record(layers=(3,), builds=("Block#ab12", "Head#cd34"))
    rec = StageRecord(**{**rec.__dict__, "layers": (LayerRecord(**{**rec.layers[0].__dict__,
                                                                   "kind": "Block#ab12"}),)})
    back = StageRecord.from_wire(through_msgpack(rec.to_wire()))
    assert back == rec and back.builds == ("Block#ab12", "Head#cd34") and back.layers[0].kind == "Block#ab12"
    older = rec.to_wire()
    del older["builds"]
    del older["layers"][0]["kind"]
    assert StageRecord.from_wire(older).builds is None and StageRecord.from_wire(older).layers[0].kind == ""
    with pytest.raises(RecordError, match="builds must be null or a list"):
        StageRecord.from_wire({**rec.to_wire(), "builds": "Block"})
    with pytest.raises(RecordError, match="builds must be a string of at most 64"):
        StageRecord.from_wire({**rec.to_wire(), "builds": ["x" * 65]})
