"""GPU utilisation and PCIe throughput through NVML, where there is an NVIDIA GPU.

``nvmlDeviceGetPcieThroughput`` blocks for its ~20 ms sampling window, which the
training thread must never pay, so a daemon thread samples every ``period_s`` and the
monitor reads the latest values. pynvml is imported only for a CUDA device; any NVML
failure turns the readings into None with one log line, never an error.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("vpipe.monitors")

__all__ = ["GpuReading", "NvmlProbe"]


@dataclass(frozen=True)
class GpuReading:
    util_pct: float | None = None
    pcie_rx_bytes_s: float | None = None
    pcie_tx_bytes_s: float | None = None


class NvmlProbe:
    """Background NVML sampler for one CUDA device; a no-op on other devices."""

    def __init__(self, device: torch.device, *, period_s: float = 0.5) -> None:
        self.device = torch.device(device)
        self.period_s = period_s
        self._latest = GpuReading()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None
        if self.device.type == "cuda":
            self._open()

    def _open(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            try:
                uuid = str(torch.cuda.get_device_properties(index).uuid)
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-")
                                                                else f"GPU-{uuid}")
            except Exception:  # noqa: BLE001 - older drivers: fall back to the index
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception as e:  # noqa: BLE001 - NVML is optional
            log.warning("NVML unavailable for %s (%s): GPU utilisation and PCIe figures will be empty",
                        self.device, e)
            return
        self._thread = threading.Thread(target=self._loop, name="vpipe-nvml", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        nvml, handle = self._nvml, self._handle
        while not self._stop.is_set():
            try:
                util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                rx = nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES) * 1024.0
                tx = nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES) * 1024.0
                self._latest = GpuReading(util, float(rx), float(tx))
            except Exception as e:  # noqa: BLE001
                log.warning("NVML sampling failed (%s); stopping it", e)
                self._latest = GpuReading()
                return
            self._stop.wait(self.period_s)

    def read(self) -> GpuReading:
        return self._latest

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
