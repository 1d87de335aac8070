"""What one stage measured in one sampled iteration, and its validated wire form.

Records travel over the control plane (msgpack) to the planner daemon, so they are plain
frozen dataclasses of ints, floats and strings; :meth:`StageRecord.from_wire` rejects
anything a peer could get wrong (missing fields, wrong types, negative or non-finite
numbers, absurd sizes) with a :class:`RecordError` naming the field. No torch import here:
the planner daemon reads records without loading torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["LayerRecord", "StageRecord", "RecordError", "GPU_ONLY_FIELDS", "MAX_LAYERS", "MAX_STAGES"]

MAX_LAYERS = 4096  # per stage; a record claiming more is malformed
MAX_STAGES = 1024  # per stats vector
_MAX_INT = (1 << 63) - 1
GPU_ONLY_FIELDS = ("gpu_util_pct", "pcie_rx_bytes_s", "pcie_tx_bytes_s")


class RecordError(ValueError):
    """A stats record that does not have the shape or ranges a record must have."""


# ---------------------------------------------------------------- field checkers
def _count(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_INT:
        raise RecordError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _index(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 31:
        raise RecordError(f"{name} must be an integer in [0, 2**31), got {value!r}")
    return value


def _amount(name: str, value: Any) -> float:
    """A finite non-negative number (seconds, bytes per second, percent)."""
    if isinstance(value, bool) or not isinstance(value,
                                                 (int, float)) or not math.isfinite(value) or value < 0:
        raise RecordError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _optional_amount(name: str, value: Any) -> float | None:
    return None if value is None else _amount(name, value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RecordError(f"{name} must be true or false, got {value!r:.40}")
    return value


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or len(value) > 64:
        raise RecordError(f"{name} must be a string of at most 64 characters, got {value!r:.80}")
    return value


def _read(cls: type, data: Any, checkers: Mapping[str, Callable[[str, Any], Any]],
          what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise RecordError(f"{what} must be a map, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    missing = sorted(names - set(data))
    if missing:
        raise RecordError(f"{what} is missing {', '.join(missing)}")
    unknown = sorted(str(k) for k in set(data) - names)
    if unknown:
        raise RecordError(f"{what} has unknown fields {', '.join(unknown)[:200]}")
    return {name: check(name, data[name]) for name, check in checkers.items()}


# ---------------------------------------------------------------- records
@dataclass(frozen=True)
class LayerRecord:
    """One layer in one sampled iteration; times are totals over the iteration's micro-batches."""

    layer_id: int
    fwd_s: float
    bwd_s: float  # includes the layer's recompute, if its activations were recomputed
    fwd_calls: int  # forwards timed (micro-batches); pipelined schedules may time fewer backwards
    bwd_calls: int
    activation_bytes: int  # saved for the backward, per micro-batch
    param_bytes: int  # parameters and buffers
    optimizer_bytes: int  # optimizer state of the layer's parameters
    output_bytes: int  # what the layer hands to the next one, per micro-batch (a boundary's size)
    kind: str = ""  # which blocks it is interchangeable with (vpipe.stage.blocks.block_kind); "" unknown
    # whether any of its parameters trains: a frozen block has no
    # weight-gradient work, so its backward is shorter
    trainable: bool = True

    @property
    def fwd_per_call_s(self) -> float:
        return self.fwd_s / self.fwd_calls if self.fwd_calls else 0.0

    @property
    def bwd_per_call_s(self) -> float:
        return self.bwd_s / self.bwd_calls if self.bwd_calls else 0.0

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, data: Any) -> LayerRecord:
        checkers = {"layer_id": _index, "fwd_s": _amount, "bwd_s": _amount, "fwd_calls": _count,
                    "bwd_calls": _count, "activation_bytes": _count, "param_bytes": _count,
                    "optimizer_bytes": _count, "output_bytes": _count, "kind": _text, "trainable": _flag}
        if isinstance(data, dict):  # fields added since the first wire form: a peer that predates them
            data = {"kind": "", "trainable": True, **data}
        return cls(**_read(cls, data, checkers, "a layer record"))


@dataclass(frozen=True)
class StageRecord:
    """One stage in one sampled iteration. GPU-only fields are None on other devices."""

    stage: int
    iteration: int
    epoch: int  # the plan (placement and policies) the stage ran this iteration under
    device: str
    t: float  # unix time when the iteration ended
    step_s: float  # wall time of the iteration on this stage (waits included)
    layers: tuple[LayerRecord, ...]
    param_bytes: int
    optimizer_bytes: int
    device_resident_bytes: int  # after the step: torch.cuda.memory_allocated, or process RSS on CPU
    device_peak_bytes: int  # during the iteration
    host_rss_bytes: int
    host_pool_used_bytes: int  # pinned swap pool, at the end of the iteration
    host_pool_peak_bytes: int
    host_pool_capacity_bytes: int
    d2h_bytes: int  # swap copies during the iteration
    d2h_s: float
    h2d_bytes: int
    h2d_s: float
    recompute_s: float
    gpu_util_pct: float | None
    pcie_rx_bytes_s: float | None
    pcie_tx_bytes_s: float | None
    # the kinds of block this stage can build for an arriving layer; None: any (a layer factory builds them)
    builds: tuple[str, ...] | None = None
    # the stage's modules outside its blocks (embeddings, norms,
    # heads): they never move, but cost time and memory
    outside_fwd_s: float = 0.0  # totals over the iteration's timed forwards, like a layer's
    outside_bwd_s: float = 0.0  # from the stage output's gradient to its last block's backward (the head's)
    outside_calls: int = 0
    outside_param_bytes: int = 0
    # one micro-batch's saved bytes on this stage with every layer kept, each storage once (0: not measured);
    # less than the layers' activation_bytes summed where two layers save the same tensor
    kept_bytes_per_mb: int = 0
    # seconds this rank spent applying the plan that took effect before this sample, if it moved layers (else
    # 0): what a move really costs, for the planner to weigh the next against its gain
    move_s: float = 0.0

    @property
    def layer_ids(self) -> list[int]:
        return [layer.layer_id for layer in self.layers]

    @property
    def compute_s(self) -> float:
        """Forward plus backward seconds of all layers in the iteration."""
        return sum(layer.fwd_s + layer.bwd_s for layer in self.layers)

    def to_wire(self) -> dict[str, Any]:
        wire = {f.name: getattr(self, f.name) for f in fields(self)}
        wire["layers"] = [layer.to_wire() for layer in self.layers]
        wire["builds"] = None if self.builds is None else list(self.builds)
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> StageRecord:
        checkers: dict[str, Callable[[str, Any], Any]] = {
            "stage": _index, "iteration": _count, "epoch": _count, "device": _text, "t": _amount,
                                                          "step_s": _amount,
            "layers": _layers,
        }
        for name in ("param_bytes", "optimizer_bytes", "device_resident_bytes", "device_peak_bytes",
                     "host_rss_bytes", "host_pool_used_bytes", "host_pool_peak_bytes",
                     "host_pool_capacity_bytes", "d2h_bytes", "h2d_bytes"):
            checkers[name] = _count
        for name in ("d2h_s", "h2d_s", "recompute_s"):
            checkers[name] = _amount
        for name in GPU_ONLY_FIELDS:
            checkers[name] = _optional_amount
        checkers.update(builds=_kinds, outside_fwd_s=_amount, outside_bwd_s=_amount, outside_calls=_count,
                        outside_param_bytes=_count, kept_bytes_per_mb=_count, move_s=_amount)
        if isinstance(data, dict):  # fields added after the first wire format: absent means none
            data = {**_OPTIONAL_STAGE_FIELDS, **data}
        return cls(**_read(cls, data, checkers, "a stage record"))


_OPTIONAL_STAGE_FIELDS = {"builds": None, "outside_fwd_s": 0.0, "outside_bwd_s": 0.0, "outside_calls": 0,
                          "outside_param_bytes": 0, "kept_bytes_per_mb": 0, "move_s": 0.0}


def _kinds(name: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) > MAX_LAYERS:
        raise RecordError(f"{name} must be null or a list of at most {MAX_LAYERS} block kinds")
    return tuple(_text(name, v) for v in value)


def _layers(name: str, value: Any) -> tuple[LayerRecord, ...]:
    if not isinstance(value, list) or len(value) > MAX_LAYERS:
        raise RecordError(f"{name} must be a list of at most {MAX_LAYERS} layer records")
    layers = tuple(LayerRecord.from_wire(item) for item in value)
    ids = [layer.layer_id for layer in layers]
    if len(set(ids)) != len(ids):
        raise RecordError(f"{name} names a layer twice: {ids[:20]}")
    return layers
