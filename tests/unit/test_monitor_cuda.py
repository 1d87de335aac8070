"""The monitor on a GPU: CUDA-event layer times, allocator memory, NVML figures (skipped without one)."""

from __future__ import annotations

import time

import pytest
import torch

from support.monitors import chain
from vpipe.monitors import StageMonitor, layers_of

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs an NVIDIA GPU")]


def test_cuda_record_has_event_times_allocator_memory_and_nvml_figures():
    device = torch.device("cuda", 0)
    model = chain(width=1024).to(device)
    monitor = StageMonitor(layers_of(model), stage_index=0, device=device, sample_every=1)
    torch.cuda.synchronize()
    time.sleep(1.0)  # let the NVML thread take a reading
    with monitor.iteration(0) as sample:
        for _ in range(3):
            model(torch.randn(256, 1024, device=device)).sum().backward()
    record = sample.record
    assert record.device == "cuda:0"
    for layer in record.layers:
        assert (layer.fwd_calls, layer.bwd_calls) == (3, 3)
        assert layer.fwd_s > 0 and layer.bwd_s > 0
    assert record.device_peak_bytes >= record.device_resident_bytes > 0
    assert record.gpu_util_pct is not None and 0 <= record.gpu_util_pct <= 100
    assert record.pcie_rx_bytes_s is not None and record.pcie_tx_bytes_s is not None
    monitor.close()
