"""Where a memory-bound step's GPU time goes: the compute stream's idle gaps and the copy streams beside them.

One step of each system of ``memory_bound_bench.py`` (same model, memory cap and vpipe budget)
runs under torch's profiler; its CUDA timeline (kernels and copies, each with its stream) is
read back from the Chrome trace and reduced to, per system:

  step         wall time of the profiled step (the profiler adds a little)
  compute      the busiest stream's kernel time, its idle time inside the step, split where the
               device finished the forwards' work (``forward``/``backward`` idle)
  copies       per copy stream, busy time and bytes (device->host, host->device)
  overlap      the share of the copy time that ran while the compute stream was busy
  gaps         the longest idle gaps of the compute stream: when (ms from the step's first
               kernel), how long, and in which phase

The gaps say what the compute stream waited for: a prefetch that arrived late shows as a gap
at a backward's start with the host->device stream busy; swap-outs that outran the forward
show as gaps late in the forward (a pack waiting for the budget) or at the first backward.

    python benchmarks/gpu_timeline.py --d-model 4096 --heads 32 --micro-batch-size 4 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_bound_bench import OutOfMemory, Runner, add_model_arguments, cap_memory, set_budget  # noqa: E402

Interval = tuple[float, float]  # microseconds, trace clock


def _merge(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _covered(intervals: list[Interval], start: float, end: float) -> float:
    """Length of ``[start, end]`` covered by the merged ``intervals``."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


def read_trace(path: str) -> dict[str, Any]:
    """Per stream: kernel and copy intervals; the step's own
    markers; which host call launched each device op."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    streams: dict[int, dict[str, Any]] = {}
    ranges: list[tuple[str, float, float]] = []
    launched: dict[int, float] = {}  # correlation id -> when the host asked for the device work
    device_work: list[tuple[int, float]] = []  # (correlation id, end) of every kernel and copy
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        correlation = e.get("args", {}).get("correlation")
        if cat == "cuda_runtime" and correlation is not None:
            launched[int(correlation)] = float(e["ts"])
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") and correlation is not None:
            device_work.append((int(correlation), float(e["ts"]) + float(e["dur"])))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            stream = streams.setdefault(int(e.get("args", {}).get("stream", -1)),
                                        {"kernel": [], "d2h": [], "h2d": [], "other": [], "d2h_bytes": 0,
                                         "h2d_bytes": 0})
            span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            if cat == "kernel":
                stream["kernel"].append(span)
            elif "DtoH" in name:
                stream["d2h"].append(span)
                stream["d2h_bytes"] += int(e.get("args", {}).get("bytes", 0))
            elif "HtoD" in name:
                stream["h2d"].append(span)
                stream["h2d_bytes"] += int(e.get("args", {}).get("bytes", 0))
            else:
                stream["other"].append(span)
        elif cat == "user_annotation" and name.startswith("bench."):
            ranges.append((name, float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return {"streams": streams, "ranges": ranges, "launched": launched, "device_work": device_work}


def _device_time_of(trace: dict[str, Any], host_t: float) -> float:
    """When the device finished the work the host had asked for by ``host_t`` (the host runs ahead of it)."""
    launched = trace["launched"]
    ends = [end for corr, end in trace["device_work"] if launched.get(corr, float("inf")) <= host_t]
    return max(ends, default=host_t)


def summarize(trace: dict[str, Any], step_s: float, gaps: int = 6) -> dict[str, Any]:
    streams, ranges = trace["streams"], trace["ranges"]
    marks = {name: (a, b) for name, a, b in ranges if name.startswith("bench.")}
    step_start, step_end = marks["bench.step"]
    # the forwards end on the device when the last work the host issued inside them finished
    forward_end = _device_time_of(trace, marks["bench.forward"][1])
    compute_id = max(streams, key=lambda s: sum(b - a for a, b in streams[s]["kernel"]))
    compute = _merge(streams[compute_id]["kernel"] + streams[compute_id]["other"])
    # the compute stream's own copies (a copy made on demand, save_on_cpu's) count as busy, not as overlap
    compute_copies = _merge(streams[compute_id]["d2h"] + streams[compute_id]["h2d"])
    busy = _merge(compute + compute_copies)
    first = min((a for a, _ in busy if a >= step_start), default=step_start)
    last = _device_time_of(trace, step_end)  # (the device finishes the step after the host issued it)
    idle_forward = (forward_end - first) - _covered(busy, first, forward_end)
    idle_backward = (last - forward_end) - _covered(busy, forward_end, last)
    holes = [(b0, a1) for (_, b0), (a1, _) in zip(busy, busy[1:]) if first <= b0 and a1 <= last]
    longest = sorted(holes, key=lambda h: h[0] - h[1])[:gaps]
    copy_rows, copy_time, hidden = [], 0.0, 0.0
    for sid, s in sorted(streams.items()):
        for direction in ("d2h", "h2d"):
            spans = _merge(s[direction])
            if not spans:
                continue
            total = sum(b - a for a, b in spans)
            under = sum(_covered(compute, a, b) for a, b in spans)
            copy_rows.append({"stream": sid, "direction": direction, "busy_ms": total / 1e3,
                              "bytes": s[f"{direction}_bytes"], "hidden": under / total if total else 0.0,
                              "on_compute_stream": sid == compute_id})
            if sid != compute_id:
                copy_time += total
                hidden += under

    return {
        "step_s": step_s,
        "phase_split": "device",  # the forward/backward boundary is the device's, not the host's
        "compute_stream": compute_id,
        "kernel_ms": sum(b - a for a, b in compute) / 1e3,
        "idle_forward_ms": idle_forward / 1e3, "idle_backward_ms": idle_backward / 1e3,
        "forward_ms": (forward_end - first) / 1e3, "backward_ms": (last - forward_end) / 1e3,
        "copies": copy_rows,
        "copy_overlap": hidden / copy_time if copy_time else None,
        "gaps": [{"at_ms": (a - first) / 1e3, "ms": (b - a) / 1e3, "phase": "forward" if a < forward_end
                  else "backward"} for a, b in longest],
    }


def profile_step(runner: Runner, system: str, n: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile, record_function

    runner.step(system, n)  # warm: the same step as the one profiled
    with tempfile.TemporaryDirectory() as tmp:
        trace = f"{tmp}/trace.json"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.sync()
            t0 = time.perf_counter()
            with record_function("bench.step"):
                runner.step(system, n, forwards=record_function("bench.forward"))
            runner.sync()
            step_s = time.perf_counter() - t0
        prof.export_chrome_trace(trace)
        return summarize(read_trace(trace), step_s)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    runner = Runner(args)
    set_budget(runner, cap_memory(runner, args.fits))
    n = args.micro_batches or 2 * args.fits
    out: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"},
                           "device": torch.cuda.get_device_name(runner.device), "torch": torch.__version__,
                           "budget_bytes": runner.manager.budget_bytes, "micro_batches": n, "systems": {}}
    for system in args.systems:
        try:
            for _ in range(2):  # the manager learns the step's order and escalates
                runner.step(system, n)
            runner.manager.metering = False
            out["systems"][system] = profile_step(runner, system, n)
        except OutOfMemory as e:
            out["systems"][system] = {"error": e.args[0][:200]}
    stats = runner.manager.stats()
    out["vpipe_policies"] = "".join(p.value for p in stats.policies.values())
    return out


def print_summary(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(f"timeline: d={cfg['d_model']} micro-batches {result['micro_batches']} x "
          f"{cfg['micro_batch_size']}, {result['device']}, torch {result['torch']}, budget "
          f"{result['budget_bytes'] / 2**30:.2f} GiB, vpipe policies {result['vpipe_policies']}")
    for system, row in result["systems"].items():
        if "error" in row:
            print(f"  {system}: {row['error']}")
            continue
        overlap = row["copy_overlap"]
        print(f"  {system:12s} step {row['step_s'] * 1e3:7.1f} ms, kernels {row['kernel_ms']:7.1f} ms; idle "
              f"forward {row['idle_forward_ms']:6.1f} of {row['forward_ms']:6.1f} ms, backward "
              f"{row['idle_backward_ms']:6.1f} of {row['backward_ms']:6.1f} ms; copies hidden "
              + (f"{overlap:.0%}" if overlap is not None else "-"))
        for c in row["copies"]:
            print(f"      stream {c['stream']:3d} {c['direction']} {c['busy_ms']:7.1f} ms "
                  f"{c['bytes'] / 2**30:6.2f} GiB {c['hidden']:.0%} under kernels"
                  + (" (compute stream)" if c["on_compute_stream"] else ""))
        for g in row["gaps"]:
            print(f"      gap at {g['at_ms']:7.1f} ms: {g['ms']:6.2f} ms ({g['phase']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    add_model_arguments(p)
    p.add_argument("--micro-batches", type=int, default=None, help="default: twice --fits")
    p.add_argument("--systems", type=lambda text: text.split(","), default=["vpipe", "checkpoint"])
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_timeline: needs a CUDA GPU", file=sys.stderr)
        return 2
    result = run(args)
    print_summary(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
