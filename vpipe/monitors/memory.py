"""Memory readings for the monitor: a layer's constant bytes, and the device's resident/peak bytes.

On a GPU the device is the CUDA caching allocator (``memory_allocated`` and its peak,
reset at the start of each sampled iteration). On CPU the "device" is the process: its
RSS from psutil, and its peak as the kernel's high-water mark ``VmHWM``, which the
process resets through ``/proc/self/clear_refs`` at the start of each sampled iteration
(psutil has no peak; ``ru_maxrss`` cannot be reset). Where that is not possible (not
Linux, no permission) the peak is the largest RSS read at the iteration's start and end.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import psutil
import torch
from torch import nn
from torch.distributed.tensor import DTensor

log = logging.getLogger("vpipe.monitors")

__all__ = ["layer_bytes", "DeviceMemory", "host_rss_bytes"]

_PROCESS = psutil.Process()


def host_rss_bytes() -> int:
    return _PROCESS.memory_info().rss


def _tensor_bytes(tensors: list[torch.Tensor], seen: set[tuple[int, torch.device]]) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, DTensor):  # an FSDP2 shard: this rank holds its local part
            t = t.to_local()
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def layer_bytes(
    layers: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer | None
) -> dict[int, tuple[int, int]]:
    """Per layer: (parameter + buffer bytes, optimizer-state bytes of its parameters)."""
    out: dict[int, tuple[int, int]] = {}
    seen: set[tuple[int, torch.device]] = set()
    # keyed by id: hashing a tensor goes through Python and costs more than the whole count
    state = {id(p): s for p, s in optimizer.state.items()} if optimizer is not None else {}
    for layer_id, module in layers.items():
        params = list(module.parameters())
        constant = _tensor_bytes(params + list(module.buffers()), seen)
        opt_tensors = [v for p in params for v in state.get(id(p), {}).values()
                       if isinstance(v, torch.Tensor)]
        out[layer_id] = (constant, _tensor_bytes(opt_tensors, seen))
    return out


class DeviceMemory:
    """Resident and peak bytes of one device, with the peak window restartable."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._is_cuda = self.device.type == "cuda"
        self._clear_refs = Path("/proc/self/clear_refs")
        self._status = Path("/proc/self/status")
        self._hwm_ok = not self._is_cuda and self._clear_refs.exists() and self._status.exists()
        self._sampled_peak = 0

    def reset_peak(self) -> None:
        if self._is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._sampled_peak = host_rss_bytes()
        if self._hwm_ok:
            try:
                self._clear_refs.write_text("5")  # 5 = reset the peak RSS (VmHWM) to the current RSS
            except OSError as e:
                log.info("cannot reset the process peak RSS (%s); sampling RSS instead", e)
                self._hwm_ok = False

    def resident(self) -> int:
        if self._is_cuda:
            return torch.cuda.memory_allocated(self.device)
        rss = host_rss_bytes()
        self._sampled_peak = max(self._sampled_peak, rss)
        return rss

    def peak(self) -> int:
        if self._is_cuda:
            return torch.cuda.max_memory_allocated(self.device)
        if self._hwm_ok:
            hwm = self._read_hwm()
            if hwm is not None:
                return max(hwm, self._sampled_peak)
        return max(self._sampled_peak, host_rss_bytes())

    def _read_hwm(self) -> int | None:
        try:
            for line in self._status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None
