"""The training monitor of one stage: per-layer times and memory for every k-th iteration.

Timing uses hooks on the layers themselves (never a wrapper module, so schedules and
``torch.func.functional_call`` see the stage's own modules), and the hooks exist only
during a sampled iteration: other iterations run exactly as without a monitor. What the hooks
mark and the times it gives are :mod:`.timing`'s: a layer's forward calls, and its share of each
backward pass (up to the next layer's start). This works for ``torch.autograd.backward`` on stage
outputs (torch's pipelining) and for vpipe's PipeDream schedule alike; the loss's own backward,
before the last layer's start, is attributed to no layer. Zero-bubble schedules' separate
weight-gradient passes are not timed. Forwards without grad (evaluation) are skipped, and
:meth:`StageMonitor.suspended` hides the pipeline's first-step shape-inference from the hooks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vpipe.monitors.clock import clock_for
from vpipe.monitors.gpu import NvmlProbe
from vpipe.monitors.held_nodes import HeldNodes
from vpipe.monitors.keep_all import KeepAllSource
from vpipe.monitors.memory import DeviceMemory, host_rss_bytes, layer_bytes
from vpipe.monitors.pulse import trains
from vpipe.monitors.records import LayerRecord, StageRecord
from vpipe.monitors.sampling import SampleSchedule
from vpipe.monitors.source import LayerFacts, SavedTensorSource, SavedTensorStats
from vpipe.monitors.timing import OUTSIDE, LayerTimer

__all__ = ["StageMonitor", "Sample", "layers_of"]

def layers_of(module: nn.Module) -> dict[int, nn.Module]:
    """A stage module's children keyed by global layer id (vpipe names children by id)."""
    try:
        return {int(name): child for name, child in module.named_children()}
    except ValueError:
        raise ValueError("the stage module's children must be named by integer layer id") from None


class _Epoch(Protocol):
    @property
    def epoch(self) -> int: ...


@dataclass
class Sample:
    """Handle of :meth:`StageMonitor.iteration`: ``record`` is set when the block ends."""

    iteration: int
    record: StageRecord | None = None


class StageMonitor:
    """Measures one stage's layers every ``sample_every``-th iteration.

    ``saved_source`` reports activation bytes and swap/recompute figures (the tensor
    manager); without one the monitor counts saved bytes itself with a
    :class:`~vpipe.monitors.keep_all.KeepAllSource` (nothing is swapped or recomputed), on
    the first micro-batch of each sampled iteration. ``facts`` gives the layers' order and kinds
    (default: by id, no kind); ``stage_module`` is timed too (see :meth:`watch_stage`).
    """

    def __init__(
        self,
        layers: Mapping[int, nn.Module],
        *,
        stage_index: int,
        device: torch.device | str,
        optimizer: torch.optim.Optimizer | None = None,
        sample_every: int = 10,
        saved_source: SavedTensorSource | None = None,
        schedule: SampleSchedule | None = None,
        facts: LayerFacts | None = None,
        stage_module: nn.Module | None = None,
    ) -> None:
        if schedule is not None and not isinstance(schedule, SampleSchedule):
            raise TypeError(f"schedule must be a SampleSchedule, got {type(schedule).__name__}")
        if saved_source is not None and not isinstance(saved_source, SavedTensorSource):
            raise TypeError(f"saved_source must have a stats() method, got {type(saved_source).__name__}")
        self.stage_index = stage_index
        self.device = torch.device(device)
        self.optimizer = optimizer
        # which iterations are measured (a session shares one among the monitors of its rank)
        self.schedule = schedule if schedule is not None else SampleSchedule(sample_every)
        self._owned_source = KeepAllSource({}, enabled=False,
                                           first_call_only=True) if saved_source is None else None
        self.saved_source: SavedTensorSource = saved_source or self._owned_source  # type: ignore[assignment]
        self._memory = DeviceMemory(self.device)
        self._nvml = NvmlProbe(self.device)
        self._layers: dict[int, nn.Module] = {}
        self._handles: dict[int, list[RemovableHandle]] = {}
        self._current: int | None = None  # the open iteration
        self._sampling = False
        self._started = 0.0
        self._baseline = SavedTensorStats()
        self.epoch = 0  # the plan in force's (records carry it), as :meth:`plan_changed` tells
        # what applying the last plan that moved layers cost this rank (the next record says)
        self.move_s = 0.0
        self.facts = facts
        self._kinds: dict[int, str] = {}
        self._constant_key: tuple[object, ...] | None = None
        self._constant: dict[int, tuple[int, int]] = {}
        self._stage_module = stage_module
        self._held = HeldNodes()
        self._timer = LayerTimer(clock_for(self.device), self._held)  # what the hooks mark, while they exist
        for layer_id, module in layers.items():
            self.add_layer(layer_id, module)

    # ---------------------------------------------------------------- layers
    @property
    def layer_ids(self) -> list[int]:
        return sorted(self._layers)

    def plan_changed(self, plan: _Epoch) -> None:
        """A plan took effect: the records carry its epoch."""
        self.epoch = plan.epoch

    def watch_stage(self, module: nn.Module) -> None:
        """Also time ``module`` (the whole stage) so the records can say what its non-block modules cost."""
        self._stage_module = module

    def add_layer(self, layer_id: int, module: nn.Module) -> None:
        """Start monitoring a layer that arrived on this stage (migration, NAS)."""
        if not isinstance(layer_id, int) or isinstance(layer_id, bool) or layer_id < 0:
            raise ValueError(f"layer id must be a non-negative integer, got {layer_id!r}")
        if layer_id in self._layers:
            raise ValueError(f"layer {layer_id} is already monitored on stage {self.stage_index}")
        self._layers[layer_id] = module
        if self._owned_source is not None:
            self._owned_source.add_layer(layer_id, module)
        if self._timer.armed:
            self._hook(layer_id)

    def remove_layer(self, layer_id: int) -> None:
        """Stop monitoring a layer that left this stage; its hooks are removed."""
        if layer_id not in self._layers:
            raise KeyError(f"layer {layer_id} is not monitored on stage {self.stage_index}")
        self._unhook(layer_id)
        del self._layers[layer_id]
        self._kinds.pop(layer_id, None)
        self._timer.forget(layer_id)
        if self._owned_source is not None:
            self._owned_source.remove_layer(layer_id)

    def retire_layer(self, layer_id: int) -> None:
        """A layer out of the forward path is not called again: its hooks stay quiet until it is removed."""
        return None

    def close(self) -> None:
        """Remove every hook (the modules are left exactly as they were) and stop NVML sampling."""
        self._disarm()
        self._current = None
        self._held.release()
        for layer_id in list(self._layers):
            self.remove_layer(layer_id)
        if self._owned_source is not None:
            self._owned_source.close()
        self._nvml.close()

    # ---------------------------------------------------------------- iterations
    @property
    def sample_every(self) -> int:
        return self.schedule.every

    def is_sampled(self, iteration: int) -> bool:
        """Iterations k-1, 2k-1, ... are measured (not 0: it carries one-off start-up costs); see
        :class:`~vpipe.monitors.sampling.SampleSchedule`."""
        return self.schedule.is_sampled(iteration)

    def begin_iteration(self, iteration: int) -> None:
        if self._current is not None:
            raise RuntimeError(f"begin_iteration({iteration}) while iteration {self._current} is still open")
        if not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be a non-negative integer, got {iteration!r}")
        self._current = iteration
        self._sampling = self.is_sampled(iteration)
        if not self._sampling:
            return
        self._timer.start(iteration)
        self._memory.reset_peak()
        self._baseline = self.saved_source.stats()
        self._arm()
        self._started = time.perf_counter()

    def end_iteration(self) -> StageRecord | None:
        """Close the open iteration; its record if it was sampled, else None."""
        if self._current is None:
            raise RuntimeError("end_iteration() without begin_iteration()")
        iteration, self._current = self._current, None
        self._held.release(before=iteration)  # the graphs of earlier steps: torch let go of them by now
        if not self._sampling:
            return None
        step_s = time.perf_counter() - self._started
        self._disarm()
        return self._record(iteration, step_s)

    def abort_iteration(self) -> None:
        """Drop the open iteration without a record (the step failed)."""
        self._disarm()
        self._current = None

    @contextmanager
    def iteration(self, iteration: int) -> Iterator[Sample]:
        sample = Sample(iteration)
        self.begin_iteration(iteration)
        try:
            yield sample
        except BaseException:
            self.abort_iteration()
            raise
        sample.record = self.end_iteration()

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Forwards and backwards inside this block are not measured (shape inference, probes)."""
        with self._timer.suspended():
            yield

    # ---------------------------------------------------------------- hooks
    def _arm(self) -> None:
        timer = self._timer
        if not timer.armed:
            timer.armed = True
            if self._owned_source is not None:  # first, so that its pre-hook runs outside the timed span
                self._owned_source.set_enabled(True)
            for layer_id in self._layers:
                self._hook(layer_id)
            if self._stage_module is not None:
                self._handles[OUTSIDE] = [
                    self._stage_module.register_forward_pre_hook(partial(timer.forward_start, OUTSIDE)),
                    self._stage_module.register_forward_hook(partial(timer.forward_end, OUTSIDE)),
                ]

    def _disarm(self) -> None:
        self._timer.armed = False
        for layer_id in list(self._handles):
            self._unhook(layer_id)
        if self._owned_source is not None:
            self._owned_source.set_enabled(False)

    def _hook(self, layer_id: int) -> None:
        module = self._layers[layer_id]
        self._handles[layer_id] = [
            module.register_forward_pre_hook(partial(self._timer.forward_start, layer_id)),
            module.register_forward_hook(partial(self._timer.forward_end, layer_id)),
        ]

    def _unhook(self, layer_id: int) -> None:
        for handle in self._handles.pop(layer_id, []):
            handle.remove()

    # ---------------------------------------------------------------- the record
    def _ordered_ids(self) -> list[int]:
        order = self.facts.layers_of(self.stage_index) if self.facts is not None else []
        known = [lid for lid in order if lid in self._layers]
        return known + sorted(set(self._layers) - set(known))

    def _record(self, iteration: int, step_s: float) -> StageRecord:
        fwd_s, fwd_calls, bwd_s, bwd_calls = self._timer.layer_times()
        stage_fwd_s, outside_calls, outside_bwd_s = fwd_s.pop(OUTSIDE, 0.0), fwd_calls.pop(OUTSIDE, 0), \
            bwd_s.pop(OUTSIDE, 0.0)
        now = self.saved_source.stats()
        base = self._baseline
        constant = self._constant_bytes()
        if self.facts is not None:
            for lid in self._layers.keys() - self._kinds.keys():
                self._kinds[lid] = self.facts.layer_kind(self._layers[lid])
        layers = tuple(
            LayerRecord(
                layer_id=lid, fwd_s=fwd_s[lid], bwd_s=bwd_s[lid], fwd_calls=fwd_calls[lid],
                bwd_calls=bwd_calls[lid], activation_bytes=int(now.activation_bytes.get(lid, 0)),
                param_bytes=constant[lid][0], optimizer_bytes=constant[lid][1],
                output_bytes=self._timer.out_bytes.get(lid, 0), kind=self._kinds.get(lid, ""),
                trainable=trains(self._layers[lid]),
            )
            for lid in self._ordered_ids()
        )
        gpu = self._nvml.read()
        builds = self.facts.can_build() if self.facts is not None else None
        move_s, self.move_s = self.move_s, 0.0
        return StageRecord(
            stage=self.stage_index,
            iteration=iteration,
            epoch=self.epoch,
            device=str(self.device),
            t=time.time(),
            step_s=step_s,
            layers=layers,
            param_bytes=sum(layer.param_bytes for layer in layers),
            optimizer_bytes=sum(layer.optimizer_bytes for layer in layers),
            device_resident_bytes=self._memory.resident(),
            device_peak_bytes=self._memory.peak(),
            host_rss_bytes=host_rss_bytes(),
            host_pool_used_bytes=int(now.host_pool_used_bytes),
            host_pool_peak_bytes=int(now.host_pool_peak_bytes),
            host_pool_capacity_bytes=int(now.host_pool_capacity_bytes),
            d2h_bytes=max(0, int(now.d2h_bytes - base.d2h_bytes)),
            d2h_s=max(0.0, float(now.d2h_s - base.d2h_s)),
            h2d_bytes=max(0, int(now.h2d_bytes - base.h2d_bytes)),
            h2d_s=max(0.0, float(now.h2d_s - base.h2d_s)),
            recompute_s=max(0.0, float(now.recompute_s - base.recompute_s)),
            gpu_util_pct=gpu.util_pct,
            pcie_rx_bytes_s=gpu.pcie_rx_bytes_s,
            pcie_tx_bytes_s=gpu.pcie_tx_bytes_s,
            builds=None if builds is None else tuple(builds),
            outside_fwd_s=max(0.0, stage_fwd_s - sum(fwd_s[lid] for lid in self._layers)) if outside_calls
                           else 0.0,
            outside_bwd_s=outside_bwd_s,
            outside_calls=outside_calls,
            outside_param_bytes=self._outside_param_bytes(layers),
            kept_bytes_per_mb=int(now.kept_bytes_per_mb),
            move_s=move_s,
        )

    def _constant_bytes(self) -> dict[int, tuple[int, int]]:
        """Per layer (parameter and buffer bytes, optimizer-state bytes): counted again only when the
        layers or the optimizer's state (it appears at the first step) changed."""
        key = (tuple((lid, id(m)) for lid, m in sorted(self._layers.items())),
               len(self.optimizer.state) if self.optimizer is not None else 0)
        if key != self._constant_key:
            self._constant_key, self._constant = key, layer_bytes(self._layers, self.optimizer)
        return self._constant

    def _outside_param_bytes(self, layers: tuple[LayerRecord, ...]) -> int:
        if self._stage_module is None:
            return 0
        total = sum(t.numel() * t.element_size() for t in self._stage_module.parameters())
        total += sum(t.numel() * t.element_size() for t in self._stage_module.buffers())
        return max(0, total - sum(layer.param_bytes for layer in layers))

