"""The GPU section of ``docs/benchmarks.md``, from ``benchmarks/gpu_suite.sh``'s
files in ``docs/results/gpu``.

Written between ``<!-- gpu:start -->`` and ``<!-- gpu:end -->``: the card and torch the
numbers came from, the ``cuda`` tests, the swap path, the tensor manager on a
launch-bound and a compute-bound transformer, and the memory-bound benchmark, each
against the targets it is held to; then the timeline of one memory-bound step.
"""

from __future__ import annotations

from typing import Any

from vpipe_lab.report.markdown import table
from vpipe_lab.report.results import Results

__all__ = ["gpu_markdown", "GPU_FILES"]

# what each suite file holds, in the order the section shows them
GPU_FILES = ("gpu_cuda_tests", "gpu_swap", "gpu_tensor_manager", "gpu_tensor_manager_compute",
             "gpu_memory_bound")


def _tests_md(data: dict[str, Any]) -> str:
    return f"- **`cuda` tests** (`pytest -m cuda`): {data['summary']}."


def _swap_md(data: dict[str, Any]) -> str:
    rows = {(r["size"], r["way"]): r["gb_per_s"] for r in data["bandwidth"]}
    size = max(s for s, _ in rows)
    pool = rows.get((size, "d2h pool (copy engine)"))
    back = rows.get((size, "h2d pool (copy engine)"))
    naive = rows.get((size, "d2h pageable (.cpu())"))
    overlap = data.get("overlap", {})
    text = f"- **Swap path** (`swap_bench.py`): {size >> 20} MiB moves at {pool:.1f} GB/s to the pinned pool"
    text += f" and {back:.1f} GB/s back" if back else ""
    text += f", against {naive:.1f} GB/s for `.cpu()`" if naive else ""
    if overlap:
        text += (f"; {overlap['swap_bytes'] >> 20} MiB of swap-outs beside "
                 f"{overlap['compute_s'] * 1e3:.0f} ms of compute overlap by {overlap['overlap']:.0%}")
    return text + "."


def _row_ratio(rows: dict[str, dict[str, Any]], name: str) -> float | None:
    row = rows.get(name)
    return row["ratio_vs_plain"] if row else None


def _times(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f}x"


def _verdict(value: float | None, target: float | None, at_most: bool = True) -> str:
    if value is None or target is None:
        return "not measured"
    met = value <= target if at_most else value >= target
    return f"{value:.2f}x vs {'<=' if at_most else '>='} {target:.2f}x: {'met' if met else 'NOT met'}"


def _prefetch_alloc_md(cfg: dict[str, Any]) -> str:
    """The clause a table's title gains when the run took prefetched
    copies from the compute stream's memory."""
    if cfg.get("prefetch_alloc") != "compute":
        return ""
    return ("; vpipe's prefetched copies allocated from the compute stream's memory "
            "(`VPIPE_PREFETCH_ALLOC=compute`)")


def _tensor_manager_md(data: dict[str, Any], title: str, targets: list[tuple[str, str, str | float]]) -> str:
    cfg = data["config"]
    rows = {r["variant"]: r for r in data["rows"]}
    body = []
    for r in data["rows"]:
        notes = []
        if r.get("policies") and set(r["policies"]) != {"D"}:
            notes.append(f"policies {r['policies']}")
        if r.get("copy_hidden") is not None:
            notes.append(f"copies {r['copy_s'] * 1e3:.1f} ms/step, {r['copy_hidden']:.0%} hidden")
        if r.get("sync_fallbacks"):
            notes.append(f"{r['sync_fallbacks']} sync fallbacks")
        body.append([r["variant"], f"{r['step_s'] * 1e3:.1f} ms", f"{r['ratio_vs_plain']:.2f}",
                     f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}", f"{r['peak_vs_plain']:.2f}",
                     "; ".join(notes)])
    checks = []
    for label, variant, target in targets:
        limit = _row_ratio(rows, target) if isinstance(target, str) else target
        checks.append(f"{label}: {_verdict(_row_ratio(rows, variant), limit)}")
    return (f"**{title}**: {cfg['blocks']} blocks, d_model {cfg['d_model']}, sequence {cfg['seq_len']}, "
            f"{cfg['micro_batches']} micro-batches of {cfg['micro_batch_size']} in GPipe "
            "order, one CPU thread, "
            f"median of {cfg['rounds']} rounds (`tensor_manager_bench.py`){_prefetch_alloc_md(cfg)}\n\n"
            + table(["variant", "step", "vs plain", "range", "peak saved vs plain", "notes"], body)
            + "\n\n" + "; ".join(checks) + ".")


def _memory_bound_md(data: dict[str, Any]) -> str:
    cfg, memory = data["config"], data["memory"]
    at = data["at_twice_plain"]
    largest_vpipe = data["largest"].get("vpipe", {})
    from_search = next((t for t in largest_vpipe.get("tried", [])
                        if t["micro_batches"] == data["micro_batches"]
                        and t["fits"]), None)
    crossed = ""
    if not at["vpipe"].get("samples_per_s") and from_search and at.get("checkpoint", {}).get("samples_per_s"):
        # the compared step ran out of memory in a round, but the batch search ran it: compare those times
        per_sample = 1.0 / at["checkpoint"]["samples_per_s"]
        crossed = (f" From the batch search's time at {data['micro_batches']} micro-batches "
                   f"({from_search['per_sample_s'] * 1e3:.2f} ms per sample): vpipe / all-recompute "
                   f"{per_sample / from_search['per_sample_s']:.2f}x.")
    rows = [[system, f"{row['samples_per_s']:.1f}" if row.get("samples_per_s") else "does not fit",
             f"{row['device_peak_bytes'] / 2**30:.2f}" if row.get("device_peak_bytes") else "-",
             "; ".join(x for x in (f"policies {row['policies']}, {row['escalations']} escalations"
                                   if "policies" in row else "",
                                   (f"{row['budget_waits']:g} waits for swap-outs per step, "
                                    f"{row['budget_wait_s'] * 1e3:.1f} ms") if row.get("budget_waits")
                                   else "",
                                   (f"copies {row['copy_s'] * 1e3:.0f} ms/step, "
                                    f"{row['copy_hidden']:.0%} hidden"
                                    if row.get("copy_hidden") is not None else ""),
                                   (f"{row['alloc_retries']:.1f} allocator retries per step"
                                    if row.get("alloc_retries") else ""),
                                   f"out of memory in {row['error'].split('. Tried')[0]}" if row.get("error")
                                   else "")
                       if x)]
            for system, row in at.items()]
    sizes = []
    for system, found in data["largest"].items():
        tried = ", ".join(f"{t['micro_batches']}: " + (f"{t['per_sample_s'] * 1e3:.2f} ms" if t["fits"]
                                                       else "OOM")
                          for t in found["tried"])
        sizes.append([system, str(found["largest"] or "none"), tried])
    cap = memory.get("cap_bytes")
    ratio = data.get("vpipe_largest_over_plain")
    return (f"**Memory-bound** (`memory_bound_bench.py`): {cfg['blocks']} blocks, d_model {cfg['d_model']}, "
            f"sequence {cfg['seq_len']}, micro-batches of {cfg['micro_batch_size']} in GPipe order; "
            + (f"the GPU's memory capped at {cap / 2**30:.2f} GiB" if cap else "no memory cap")
            + f" so that plain holds {data['plain_largest']} micro-batches; vpipe's "
            f"budget {data['budget_bytes'] / 2**30:.2f} GiB (0.8 x what plain's largest batch saves)"
            + _prefetch_alloc_md(cfg) + f". At {data['micro_batches']} micro-batches:\n\n"
            + table(["system", "samples/s", "device peak GiB", "vpipe's choice / error"], rows)
            + f"\n\nvpipe / all-recompute: {_verdict(data['vpipe_over_checkpoint'], 1.15, at_most=False)}; "
              f"vpipe / save_on_cpu {_times(data['vpipe_over_save_on_cpu'])}.{crossed}\n\n"
              "Largest batch (micro-batches) within 10% of plain's per-sample time at plain's largest "
              f"({data['per_sample_limit_s'] * 1e3:.2f} ms per sample at most):\n\n"
            + table(["system", "largest", "per-sample time by micro-batches tried"], sizes)
            + "\n\nvpipe's largest / plain's: "
              + (_verdict(ratio, 2.0, at_most=False) if ratio else "none within 10%") + ".")


def _timeline_md(data: dict[str, Any]) -> str:
    cfg = data["config"]
    lines = ([f"**Timeline of one step** (`gpu_timeline.py`): d_model {cfg['d_model']}, "
              f"{data['micro_batches']} "
             f"micro-batches of {cfg['micro_batch_size']}, the memory-bound benchmark's cap and budget "
             f"(vpipe {data['vpipe_policies']}); the compute stream's idle time, the copies and the longest "
             "gaps (ms from the step's first kernel):"])
    for system, row in data["systems"].items():
        if "error" in row:
            lines.append(f"- {system}: {row['error']}")
            continue
        copies = ", ".join(f"{c['direction']} {c['busy_ms']:.0f} ms ({c['bytes'] / 2**30:.2f} GiB, "
                           f"{c['hidden']:.0%} under kernels)" for c in row["copies"]
                           if not c["on_compute_stream"])
        split = row.get("phase_split") == "device"
        gaps = ", ".join(f"{g['ms']:.1f} ms at {g['at_ms']:.0f} ms" + (f" ({g['phase']})" if split else "")
                         for g in row["gaps"][:4] if g["ms"] >= 1.0)
        if row.get("phase_split") == "device":
            idle = (f"idle {row['idle_forward_ms']:.1f} of {row['forward_ms']:.0f} ms in the forward, "
                    f"{row['idle_backward_ms']:.1f} of {row['backward_ms']:.0f} ms in the backward")
        else:  # an older file split the phases at the host's time: only the total holds
            idle = (f"idle {row['idle_forward_ms'] + row['idle_backward_ms']:.1f} of "
                    f"{row['forward_ms'] + row['backward_ms']:.0f} ms")
        lines.append(f"- {system}: step {row['step_s'] * 1e3:.0f} ms; {idle}" + (f"; copies {copies}"
                                                                                 if copies else "")
                     + (f"; longest gaps {gaps}" if gaps else ""))
    return "\n".join(lines)


def _host_cost_md(data: dict[str, Any]) -> str:
    cfg = data["config"]
    rows = [[r["variant"], f"{r['bytecodes']:,}", f"{r['vpipe_bytecodes']:,}", f"{r['operations']:,}",
             f"{r['operations_beyond_plain']:,}",
             ", ".join(f"{name.removeprefix('aten.')} {n}" for name, n in r["most_beyond_plain"])]
            for r in data["rows"]]
    return (f"**Host cost per step, counted** (`host_cost.py`): the launch-bound model ({cfg['blocks']} "
            f"blocks, d_model {cfg['d_model']}, {cfg['micro_batches']} micro-batches of "
            f"{cfg['micro_batch_size']}), one unmetered step: Python bytecodes executed and tensor "
            "operations dispatched (each a launch, an allocation or a copy on the GPU)\n\n"
            + table(["variant", "bytecodes", "of them vpipe's", "tensor operations", "beyond plain",
                     "most beyond plain"], rows))


def gpu_markdown(results: Results) -> str:
    """The GPU section's body; says which suite files are missing."""
    found = [name for name in GPU_FILES if name in results]
    if not found:
        return ("_No GPU results in `docs/results/gpu`: run `benchmarks/gpu_suite.sh` on a "
                "machine with a GPU._")
    source = next((results[n] for n in ("gpu_memory_bound", "gpu_tensor_manager", "gpu_swap")
                   if n in results), {})
    parts = [f"Measured on {source.get('device', 'a GPU')} with torch {source.get('torch', '?')} by "
             "`benchmarks/gpu_suite.sh`; raw files in `docs/results/gpu/`."]
    if "gpu_cuda_tests" in results:
        parts.append(_tests_md(results["gpu_cuda_tests"]))
    if "gpu_swap" in results:
        parts.append(_swap_md(results["gpu_swap"]))
    if "gpu_tensor_manager" in results:
        parts.append(_tensor_manager_md(results["gpu_tensor_manager"], "Launch-bound transformer", [
            ("every layer kept", "vpipe D", 1.02), ("all swapped vs save_on_cpu", "vpipe S", "save_on_cpu"),
            ("all recomputed vs checkpoint", "vpipe R", "checkpoint")]))
    if "gpu_launch_bound_compute_alloc" in results:
        parts.append(_tensor_manager_md(results["gpu_launch_bound_compute_alloc"], "Launch-bound transformer",
                                        [
            ("all swapped vs save_on_cpu", "vpipe S", "save_on_cpu")]))
    if "gpu_host_cost" in results:
        parts.append(_host_cost_md(results["gpu_host_cost"]))
    if "gpu_tensor_manager_compute" in results:
        parts.append(_tensor_manager_md(results["gpu_tensor_manager_compute"], "Compute-bound transformer", [
            ("all swapped", "vpipe S", 1.10), ("all recomputed vs checkpoint", "vpipe R", "checkpoint")]))
    for name in sorted(n for n in results if n.startswith("gpu_memory_bound")):  # one file per model size
        parts.append(_memory_bound_md(results[name]))
    for name in sorted(n for n in results if n.startswith("gpu_timeline")):
        parts.append(_timeline_md(results[name]))
    missing = [name[len("gpu_"):] for name in GPU_FILES if name not in results]
    if missing:
        parts.append("_Not in this run: " + ", ".join(f"`{m}.json`" for m in missing) + "._")
    return "\n\n".join(parts)
