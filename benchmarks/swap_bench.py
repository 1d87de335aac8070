"""Swap path bandwidth and overlap: the host pool and copy streams vs the naive ways.

Bandwidth (per size): device->host into the (pinned) pool through the copy engine, vs
``tensor.cpu()`` into pageable memory, vs ``pin_memory()`` per tensor (what the pool
avoids); host->device from the pool vs from pageable memory.

Overlap (CUDA only): a compute loop alone, the swap-outs alone, then both together: the
overlap is the part of the shorter one hidden behind the longer. On CPU copies are
synchronous memcpy and there is nothing to overlap; the table says so.

    python benchmarks/swap_bench.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vpipe.tensor_manager.accounting import format_bytes  # noqa: E402
from vpipe.tensor_manager.copy_engine import make_copy_engine  # noqa: E402
from vpipe.tensor_manager.pool import HostPool  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` (device work included)."""
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bandwidth_rows(device: torch.device, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    engine = make_copy_engine(device)
    pool = HostPool(2 * max(sizes) + (64 << 20), pinned=engine.pinned, chunk_bytes=2 * max(sizes))
    rows = []
    for size in sizes:
        src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
        block = pool.alloc(size)
        pageable = torch.empty(size, dtype=torch.uint8)
        ways: dict[str, Callable[[], Any]] = {
            "d2h pool (copy engine)": lambda: engine.to_host(src, block.data),
            "h2d pool (copy engine)": lambda: engine.to_device(block.data),
        }
        if device.type == "cuda":
            ways["d2h pageable (.cpu())"] = lambda: src.cpu()
            ways["d2h pin_memory() per tensor"] = lambda: src.cpu().pin_memory()
            ways["h2d pageable"] = lambda: pageable.to(device)
        else:  # "device" and host are one memory: the reference is a plain copy
            ways["memcpy reference (clone)"] = lambda: src.clone()
        for way, fn in ways.items():
            seconds = _time(fn, device, repeats)
            rows.append({"size": size, "way": way, "seconds": seconds, "gb_per_s": size / seconds / 1e9})
        pool.free(block)
    return rows


def overlap_row(device: torch.device, swap_bytes: int, repeats: int) -> dict[str, Any]:
    if device.type != "cuda":
        return {"note": "CPU: copies are synchronous memcpy, nothing overlaps"}
    engine = make_copy_engine(device)
    pool = HostPool(swap_bytes + (64 << 20), pinned=True, chunk_bytes=swap_bytes + (64 << 20))
    block = pool.alloc(swap_bytes)
    src = torch.randint(0, 255, (swap_bytes,), dtype=torch.uint8, device=device)
    a = torch.randn(4096, 4096, device=device)

    def compute() -> None:
        for _ in range(8):
            a.mul_(0.999).matmul(a)

    def copy() -> None:
        engine.to_host(src, block.data)

    def both() -> None:
        copy()
        compute()

    t_compute = _time(compute, device, repeats)
    t_copy = _time(copy, device, repeats)
    t_both = _time(both, device, repeats)
    hidden = t_compute + t_copy - t_both
    return {"swap_bytes": swap_bytes, "compute_s": t_compute, "copy_s": t_copy, "both_s": t_both,
            "overlap": max(0.0, hidden) / min(t_compute, t_copy)}


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    table = Table(title=f"swap path bandwidth on {result['device']} (median of {result['repeats']})")
    for col in ("size", "way", "time", "GB/s"):
        table.add_column(col, justify="left" if col == "way" else "right")
    for row in result["bandwidth"]:
        table.add_row(format_bytes(row["size"]), row["way"], f"{row['seconds'] * 1e3:.3f} ms",
                      f"{row['gb_per_s']:.2f}")
    console.print(table)
    o = result["overlap"]
    table = Table(title="swap-out overlapping compute")
    if "note" in o:
        table.add_column("note")
        table.add_row(o["note"])
    else:
        for col in ("swap", "compute alone", "copy alone", "both", "overlap of the shorter"):
            table.add_column(col, justify="right")
        table.add_row(format_bytes(o["swap_bytes"]), f"{o['compute_s'] * 1e3:.2f} ms",
                      f"{o['copy_s'] * 1e3:.2f} ms",
                      f"{o['both_s'] * 1e3:.2f} ms", f"{o['overlap']:.0%}")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="262144,4194304,67108864", help="bytes, comma-separated")
    p.add_argument("--overlap-bytes", type=int, default=256 << 20)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "torch": torch.__version__, "repeats": args.repeats,
        "bandwidth": bandwidth_rows(device, sizes, args.repeats),
        "overlap": overlap_row(device, args.overlap_bytes, args.repeats),
    }
    print_tables(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
