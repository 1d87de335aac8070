"""Benchmark results users can read: the README's headline table, docs tables and plots, from the JSON.

``vpipe bench --json DIR`` leaves ``DIR/NAME.json`` per benchmark. This module turns them
into markdown, and writes it between markers in existing files, so no number in the
README or ``docs/benchmarks.md`` is typed in by hand:

- ``<!-- headline:start -->`` ... ``<!-- headline:end -->``: one row per headline result;
- ``<!-- results:start -->`` ... ``<!-- results:end -->``: every benchmark's full table.

``--plots DIR`` also draws PNGs (needs matplotlib, the ``plot`` extra). Benchmarks whose
JSON is missing are left out and said so.

    python -m vpipe.report docs/results --readme README.md --docs docs/benchmarks.md --plots docs/img
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["load_results", "headline_rows", "headline_markdown", "results_markdown", "replace_between", "plot"]

Results = dict[str, dict[str, Any]]


def load_results(directory: Path) -> Results:
    """Every ``NAME.json`` in ``directory`` (``bench.json``, the run's status, under ``"bench"``)."""
    if not directory.is_dir():
        raise ValueError(f"no results directory {directory}; run `vpipe bench --json {directory}` first")
    results = {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}
    gpu = directory / "gpu"  # benchmarks/gpu_suite.sh's files, copied from a GPU machine
    results.update({f"gpu_{p.stem}": json.loads(p.read_text()) for p in sorted(gpu.glob("*.json"))})
    return results


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _ratio(spread: dict[str, float] | None) -> str:
    return "-" if not spread else f"{spread['median']:.2f}x ({spread['min']:.2f}-{spread['max']:.2f})"


# ---------------------------------------------------------------------- headline
def headline_rows(results: Results) -> list[list[str]]:
    """``[what, vpipe, baseline, ratio]`` rows from whichever benchmarks have results."""
    rows: list[list[str]] = []
    for case in results.get("throughput", {}).get("cases", []):
        ran = [r for r in case["rows"] if r.get("samples_per_s")]
        budgeted = [r for r in ran if "no budget" not in r["system"]]
        best_v = max((r for r in budgeted if r["vpipe"]), key=lambda r: r["samples_per_s"], default=None)
        best_b = max((r for r in budgeted if not r["vpipe"]), key=lambda r: r["samples_per_s"], default=None)
        if best_v and best_b:
            rows.append([f"throughput, {case['model']} on {case['stages']} CPU stages, same memory budget",
                         f"{best_v['system']}: {best_v['samples_per_s']:.0f} samples/s "
                         f"({best_v['of_ideal']:.0%} of ideal)",
                         f"{best_b['system']}: {best_b['samples_per_s']:.0f} samples/s ({best_b['of_ideal']:.0%})",
                         f"{best_v['samples_per_s'] / best_b['samples_per_s']:.2f}x"])
    for case in results.get("microbatch", {}).get("cases", []):
        by = {r["system"]: r for r in case["rows"]}
        best = max((r for r in case["rows"] if r["vpipe"]), key=lambda r: r["max_micro_batch_size"])
        ref = by.get("PipeDream (all D)")
        if ref and ref["max_micro_batch_size"]:
            rows.append([f"largest micro-batch, {case['model']} on {case['stages']} stages, same budget",
                         f"{best['system']}: {best['max_micro_batch_size']}",
                         f"PipeDream: {ref['max_micro_batch_size']}", f"{best['vs_pipedream']:.2f}x"])
    planner = results.get("planner", {}).get("rows", [])
    if planner:
        rows.append(_planner_headline(planner))
    for r in results.get("simulator", {}).get("validation", []):
        on = r.get("calibrated_on_stages") or r["stages"]
        rows.append([f"simulator vs real run, {r['stages']} stages ({r['schedule']}"
                     + (f", calibrated on {on} stages)" if on != r["stages"] else ")"),
                     f"predicted {r['predicted_s'] * 1e3:.0f} ms/step", f"measured {r['measured_s'] * 1e3:.0f} ms",
                     f"{r['error']:+.1%}"])
    migration = results.get("migration", {})
    mig = {r["method"]: r for r in migration.get("rows", [])}
    live, sac = mig.get("live (vpipe)"), mig.get("stop-and-copy")
    if live and sac:
        rows.append(["repartition cost, 2 stages (stall / step)",
                     f"live move: {live['stall_ratio']:.1%} (the move itself {migration['live_boundary_ratio']:.1%})",
                     f"stop-and-copy: {sac['stall_ratio']:.0%}",
                     f"{sac['stall_ratio'] / max(live['stall_ratio'], migration['live_boundary_ratio']):.0f}x less"])
    nas = results.get("nas", {})
    if nas.get("per_round"):
        after = {name: statistics.median(r["throughput"][name]["after"] for r in nas["per_round"])
                 for name in ("static", "vpipe")}
        rows.append(["NAS edit: 8 blocks added to stage 0 of 2, throughput after it",
                     f"vpipe: {after['vpipe']:.0f} samples/s ({nas['vpipe_over_optimal_after']['median']:.0%} of the "
                     f"optimal static partition; per round, 90% of it reached after: {_steps(nas['recovery_steps'])})",
                     f"static: {after['static']:.0f} samples/s "
                     f"({nas['static_over_optimal_after']['median']:.0%} of optimal)",
                     _ratio(nas["vpipe_over_static_after"])])
    memory = results.get("memory", {})
    if memory.get("samples_per_s"):
        fits = memory["within_budget"]
        rows.append([f"a {memory['budget_bytes'] / 2**20:.0f} MiB/stage budget plain 1F1B exceeds (2 stages)",
                     f"1F1B + vpipe: {memory['samples_per_s']['vpipe']:.0f} samples/s, "
                     f"{'within' if fits['vpipe'] else 'OVER'} budget",
                     f"GPipe, all recomputed: {memory['samples_per_s']['gpipe_recompute']:.0f} samples/s",
                     _ratio(memory["vpipe_over_recompute"])])
    shapes = results.get("shapes", {}).get("rows", [])
    if shapes:
        worst = max(shapes, key=lambda r: r["vpipe_over_balanced"])
        rows.append([f"the one line on users' trainers ({', '.join(r['shape'] for r in shapes)}), 6,2 split on 2 "
                     "stages",
                     "+ vpipe: " + ", ".join(f"{r['vpipe_step_s'] * 1e3:.0f}" for r in shapes) + " ms/step",
                     "hand-balanced 4,4: " + ", ".join(f"{r['balanced_step_s'] * 1e3:.0f}" for r in shapes)
                     + " ms/step",
                     f"{worst['vpipe_over_balanced']:.2f}x at worst"])
    for row in results.get("overhead", {}).get("rows", []):
        lo = min(row["attached_range"][0], row["planned_range"][0])
        hi = max(row["attached_range"][1], row["planned_range"][1])
        rows.append([f"attaching to a balanced 2-stage pipeline that fits, {row['size']} model "
                     f"({row['plain_step_s'] * 1e3:.0f} ms steps)",
                     f"attached: {row['attached_over_plain']:.3f}x plain, planner on: "
                     f"{row['planned_over_plain']:.3f}x ({row['plans_applied']} plans applied)",
                     f"plain: {row['plain_step_s'] * 1e3:.1f} ms/step",
                     f"{max(row['attached_over_plain'], row['planned_over_plain']):.3f}x at worst "
                     f"({lo:.2f}-{hi:.2f})"])
    swap = results.get("gpu_swap", {})
    if swap.get("bandwidth"):
        by = {(r["size"], r["way"]): r["gb_per_s"] for r in swap["bandwidth"]}
        size = max(r["size"] for r in swap["bandwidth"])
        pool, pageable = by.get((size, "d2h pool (copy engine)")), by.get((size, "d2h pageable (.cpu())"))
        if pool and pageable:
            rows.append([f"GPU swap-out of {size >> 20} MiB ({swap['device'].split('(')[-1].rstrip(')')})",
                         f"pinned pool: {pool:.1f} GB/s, {swap['overlap']['overlap']:.0%} hidden under compute",
                         f"`.cpu()`: {pageable:.1f} GB/s", f"{pool / pageable:.0f}x"])
    return rows


def _steps(recoveries: list[int | None]) -> str:
    """One entry per round: ``"22 steps, never"``; ``"never"`` alone when no round got there."""
    if all(s is None for s in recoveries):
        return "never"
    return ", ".join("never" if s is None else f"{s} steps" for s in recoveries)


def headline_markdown(results: Results) -> str:
    rows = headline_rows(results)
    if not rows:
        return "_No benchmark results yet: run `vpipe bench --json docs/results`._"
    return (_table(["result", "vpipe", "baseline", "vpipe vs baseline"], rows)
            + "\n\nFrom `docs/results/*.json` (2-core shared CPU; the GPU row from one H100, `docs/results/gpu/`), "
              "regenerated by "
              "`python -m vpipe.report`; details in [docs/benchmarks.md](docs/benchmarks.md).")


# ---------------------------------------------------------------------- full tables
def _throughput_md(data: dict[str, Any]) -> str:
    parts = []
    for case in data["cases"]:
        rows = []
        for r in case["rows"]:
            if not r.get("samples_per_s"):
                rows.append([r["system"], "-", "does not fit", "", "", ""])
                continue
            rows.append([r["system"], f"{r['micro_batch_size']} x {r['micro_batches']}", f"{r['samples_per_s']:.1f}",
                         _ratio(r.get("vs_without_vpipe")), _ratio(r.get("vs_gpipe")), f"{r['of_ideal']:.0%}"])
        virtual = f" ({case['virtual_partition']} on the virtual stages)" if case.get("virtual_partition") else ""
        parts.append(f"**{case['model']} on {case['stages']} stages**: budget {case['budget_bytes'] / 2**20:.1f} MiB "
                     f"per rank, global batch {case['global_batch']}, partition {case['partition']}{virtual}, ideal "
                     f"{case['ideal_samples_per_s']:.0f} samples/s\n\n"
                     + _table(["system", "mb x n", "samples/s", "vs without vpipe", "vs GPipe (all R)", "of ideal"],
                              rows))
    return "\n\n".join(parts)


def _microbatch_md(data: dict[str, Any]) -> str:
    parts = []
    for case in data["cases"]:
        rows = [[r["system"], (">= " if r["capped"] else "") + str(r["max_micro_batch_size"]),
                 "-" if r["vs_pipedream"] is None else f"{r['vs_pipedream']:.2f}x", " \\| ".join(r["policies"] or [])]
                for r in case["rows"]]
        parts.append(f"**{case['model']} on {case['stages']} stages**, {case['micro_batches']} micro-batches, budget "
                     f"{case['budget_bytes'] / 2**20:.1f} MiB per stage ({case['budget_rule']})\n\n"
                     + _table(["system", "max micro-batch", "vs PipeDream", "vpipe's policies at max"], rows))
    return "\n\n".join(parts)


def _planner_headline(planner: list[dict[str, Any]]) -> list[str]:
    """The worst gap to the optimum over every graph and size, the slowest plan, and
    networkx's plain KL on the biggest case."""
    worst = max(planner, key=lambda r: r["kl_gap"])
    slowest = max(planner, key=lambda r: r["kl_s_median"])
    big = max(planner, key=lambda r: (r["nodes"], r["stages"]))
    stages = sorted({r["stages"] for r in planner})
    nodes = sorted({r["nodes"] for r in planner})
    return [f"planner, paper graphs ({nodes[0]}-{nodes[-1]} nodes) on {stages[0]}-{stages[-1]} stages",
            f"worst gap to optimum {worst['kl_gap']:+.2%} ({worst['graph']}, {worst['stages']} stages); "
            f"slowest plan {slowest['kl_s_median'] * 1e3:.0f} ms ({slowest['graph']}, {slowest['stages']} stages)",
            f"networkx KL, {big['graph']} on {big['stages']} stages: {big['nx_s'] * 1e3:.0f} ms, gap "
            f"{big['nx_gap']:+.0%}, {'valid' if big['nx_valid'] else 'not a valid pipeline'}" if "nx_s" in big else "-",
            f"{big['nx_s'] / big['kl_s_median']:.1f}x faster" if "nx_s" in big else "-"]


def _planner_md(data: dict[str, Any]) -> str:
    rows = [[r["graph"], str(r["nodes"]), str(r["stages"]), f"{r['kl_s_median'] * 1e3:.0f}", f"{r['kl_gap']:+.2%}",
             f"{r['exact_s'] * 1e3:.0f}", f"{r['nx_s'] * 1e3:.0f}" if "nx_s" in r else "-",
             ("yes" if r["nx_valid"] else "no") if "nx_valid" in r else "-",
             f"{r['nx_gap']:+.0%}" if "nx_gap" in r else "-"] for r in data["rows"]]
    return _table(["graph", "nodes", "stages", "vpipe ms", "gap to exact", "exact ms", "networkx KL ms",
                   "KL valid pipeline", "KL gap"], rows)


def _simulator_md(data: dict[str, Any]) -> str:
    parts = []
    if data.get("validation"):
        rows = [[str(r["stages"]), r["schedule"], f"{r['predicted_s'] * 1e3:.0f}", f"{r['measured_s'] * 1e3:.0f}",
                 f"{r['error']:+.1%}", f"{r['background']:.1f}", f"{r['action_overhead_s'] * 1e3:.2f}",
                 f"{r.get('compute_scale', 1.0):.2f}", str(r.get("calibrated_on_stages") or r["stages"])]
                for r in data["validation"]]
        parts.append("Validation against real runs on this machine:\n\n" + _table(
            ["stages", "schedule", "predicted ms", "measured ms", "error", "outside load (runnable threads)",
             "calibrated overhead per action (ms)", "calibrated compute scale", "calibrated on (stages)"], rows))
    systems = list(data["projection"][0]["systems"]) if data.get("projection") else []
    rows = [[str(r["stages"]), f"{r['ratio']:g}", f"{r['speedup']:.0f}x",
             *(f"{r['systems'][n]['of_ideal']:.0%}" for n in systems)]
            for r in data.get("projection", [])]
    if rows:
        link = data["link"]
        parts.append(f"Projection (fraction of ideal; PCIe {link['swap_bytes_per_s'] / 1e9:g} GB/s swaps overlapped "
                     f"with compute, {link['send_bytes_per_s'] / 1e9:g} GB/s between stages):\n\n"
                     + _table(["stages", "block compute / PCIe round trip", "compute speedup over this CPU", *systems],
                              rows))
    return "\n\n".join(parts)


def _migration_md(data: dict[str, Any]) -> str:
    rows = [[r["method"], str(len(r["stalls_s"])), f"{r['stall_median_s'] * 1e3:.1f}", f"{r['stall_ratio']:.1%}",
             f"{r['step_s'] * 1e3:.0f}"] for r in data["rows"]]
    return _table(["method", "moves", "stall median ms", "stall / step", "step ms"], rows)


def _nas_md(data: dict[str, Any]) -> str:
    rounds = data["per_round"]
    phases = ("before", "transition", "after")

    def med(name: str, phase: str) -> str:
        return f"{statistics.median(r['throughput'][name][phase] for r in rounds):.1f}"

    rows = [[name, *(med(name, ph) for ph in phases), _ratio(data[f"{name}_over_optimal_after"]),
             _steps([r["recovery_steps" if name == "vpipe" else "static_recovery_steps"] for r in rounds])]
            for name in ("static", "vpipe")]
    optimal = statistics.median(r["throughput"]["optimal"]["steady"] for r in rounds)
    rows.append([f"optimal static {data['config'].get('optimal_partition', '')}", "", "", f"{optimal:.1f}", "1.00x",
                 ""])
    cfg = data["config"]
    return (f"{cfg['added']} blocks added to stage 0 of a {cfg['blocks']}-block transformer at step {cfg['add_step']} "
            f"of {cfg['steps']} (2 stages, 1F1B), {len(rounds)} rounds; samples/s, median over rounds:\n\n"
            + _table(["run", "before", "transition (30 steps)", "after", "after / optimal",
                      "steps to 90% of optimal"], rows)
            + f"\n\nvpipe / static after the edit: {_ratio(data['vpipe_over_static_after'])}.")


def _memory_md(data: dict[str, Any]) -> str:
    mib = 2**20
    rows = [[name, f"{data['samples_per_s'][name]:.1f}" if name in data["samples_per_s"] else "not run (over budget)",
             ", ".join(f"{b / mib:.1f}" for b in footprints), "yes" if data["within_budget"][name] else "no"]
            for name, footprints in data["footprint_bytes"].items()]
    return (f"Budget {data['budget_bytes'] / mib:.0f} MiB per stage, 2 stages, micro-batch "
            f"{data['model']['micro_batch_size']}:\n\n"
            + _table(["run", "samples/s", "stage footprints (MiB)", "within budget"], rows)
            + f"\n\nvpipe / GPipe with every layer recomputed: {_ratio(data['vpipe_over_recompute'])}; vpipe's "
              f"policies per stage at the end (layer: policy): "
              f"{' / '.join(' '.join(f'{k}:{v}' for k, v in stage.items()) for stage in data['vpipe_policies'])}.")


def _shapes_md(data: dict[str, Any]) -> str:
    rows = [[r["shape"], f"{r['balanced_step_s'] * 1e3:.0f}", f"{r['uneven_step_s'] * 1e3:.0f}",
             f"{r['vpipe_step_s'] * 1e3:.0f}",
             f"{r['vpipe_over_balanced']:.2f}x ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})",
             f"{r['uneven_over_balanced']:.2f}x",
             ",".join(map(str, r["final_partition"])) + (f" at step {r['moved_at_step']}" if r["moved"] else " (none)")]
            for r in data["rows"]]
    skipped = "".join(f" {name} skipped: {why}." for name, why in data.get("skipped", {}).items())
    return (f"2 CPU stages, 1F1B, {data['steps']} steps per run, median step of the last {data['measure_steps']}, "
            f"{data['rounds']} round(s) (runs alternate):\n\n"
            + _table(["trainer", "4,4 plain ms", "6,2 plain ms", "6,2 + vpipe ms", "vpipe / 4,4", "6,2 / 4,4",
                      "vpipe's split"], rows) + skipped)


def _overhead_md(data: dict[str, Any]) -> str:
    rows = [[r["size"], str(r["steps"]), f"{r['plain_step_s'] * 1e3:.1f}",
             f"{r['attached_step_s'] * 1e3:.1f}",
             f"{r['attached_over_plain']:.3f}x ({r['attached_range'][0]:.3f}-{r['attached_range'][1]:.3f})",
             f"{r['planned_step_s'] * 1e3:.1f}",
             f"{r['planned_over_plain']:.3f}x ({r['planned_range'][0]:.3f}-{r['planned_range'][1]:.3f})",
             str(r["plans_applied"])] for r in data["rows"]]
    text = (f"`examples/train_sequential.py` on 2 CPU stages split 4,4 (1F1B), {data['rounds']} rounds of plain, "
            "attached (`planning=False`) and planned (the one line's defaults) in alternating order; mean step "
            "of each run's second half, ratios to plain within a round:\n\n"
            + _table(["model", "steps", "plain ms", "attached ms", "attached / plain", "planned ms",
                      "planned / plain", "plans applied"], rows))
    breakdown = data.get("breakdown")
    if breakdown:
        parts = [[str(r["rank"]), f"{r['step_s'] * 1e3:.1f}", f"{r['per_step_s']['step'] * 1e6:.0f}"]
                 + [f"{r['per_step_s'][g] * 1e6:.0f} ({r['calls_per_step'][g]:.0f} calls)"
                    for g in ("micro-batch", "layer call", "saved tensor")] for r in breakdown["ranks"]]
        text += ("\n\nWhere vpipe's own time goes, per step of the small attached run (microseconds, under cProfile, "
                 f"which inflates every Python call: upper bounds; {breakdown['steps']} steps, the saved-tensor hooks "
                 "run on the monitor's sampled steps only):\n\n"
                 + _table(["rank", "step ms", "per step (boundary, monitor, control)", "per micro-batch",
                           "per layer call", "per saved tensor"], parts))
    return text


def _soak_md(data: dict[str, Any]) -> str:
    mib = 2**20
    rows = [[str(r["rank"]), str(r["plans_applied"]), f"{r['rss_first_bytes'] / mib:.1f}",
             f"{r['rss_mid_bytes'] / mib:.1f}", f"{r['rss_end_bytes'] / mib:.1f}",
             f"{r['rss_growth_second_half']:+.2%}", f"{r['pool_peak_bytes'] / 1024:.0f}",
             f"{r['pool_used_end_bytes'] / 1024:.0f}"] for r in data["ranks"]]
    return (f"{data['steps']} steps on 2 stages, a forced plan (partition and policies) every {data['move_every']} "
            f"steps ({data['forced_plans']} plans):\n\n"
            + _table(["rank", "plans applied", "RSS start MiB", "RSS mid MiB", "RSS end MiB", "growth 2nd half",
                      "host pool peak KiB", "host pool in use at end KiB"], rows)
            + f"\n\nFinal parameters equal the no-migration reference bit for bit: "
              f"{'yes' if data['params_equal_reference'] else 'NO'}; RSS growth target < {data['rss_target']:.0%}.")


SECTIONS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "throughput": ("Throughput vs baselines", _throughput_md),
    "microbatch": ("Largest micro-batch under one budget", _microbatch_md),
    "planner": ("Planner: time and gap to the optimum", _planner_md),
    "simulator": ("Simulator: validation and projection", _simulator_md),
    "migration": ("Repartition cost", _migration_md),
    "nas": ("A NAS edit: static vs vpipe vs the optimal partition", _nas_md),
    "memory": ("A budget plain 1F1B exceeds", _memory_md),
    "soak": ("Soak: memory over thousands of moves", _soak_md),
    "shapes": ("The one line on users' trainers", _shapes_md),
    "overhead": ("What attaching costs when there is nothing to gain", _overhead_md),
}


def results_markdown(results: Results) -> str:
    parts = []
    for name, (title, render) in SECTIONS.items():
        body = render(results[name]) if name in results else f"_No `{name}.json`: run `vpipe bench {name}`._"
        parts.append(f"### {title} (`vpipe bench {name}`)\n\n{body}")
    others = sorted(set(results) - set(SECTIONS) - {"bench"})
    if others:
        parts.append("Other results in the directory (see their scripts): " + ", ".join(f"`{o}.json`" for o in others))
    if "bench" in results:
        status = results["bench"]
        rows = [[r["name"], r["status"], f"{r['seconds']:.0f}", r.get("reason", "")] for r in status["benchmarks"]]
        parts.append(f"Run status (`bench.json`), {status['total_s']:.0f} s in all:\n\n"
                     + _table(["benchmark", "status", "seconds", "note"], rows))
    return "\n\n".join(parts)


def replace_between(text: str, marker: str, body: str) -> str:
    """``text`` with what lies between ``<!-- marker:start -->`` and ``<!-- marker:end -->`` replaced by ``body``."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"markers {start} ... {end} not found")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text, count=1)


# ---------------------------------------------------------------------- plots
def plot(results: Results, directory: Path) -> list[Path]:
    """PNG plots of the throughput, micro-batch and projection results; returns the files written."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'vpipe[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    if "throughput" in results:
        cases = results["throughput"]["cases"]
        fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 4), sharey=True, squeeze=False)
        for ax, case in zip(axes[0], cases):
            ran = [r for r in case["rows"] if r.get("samples_per_s")]
            ax.barh([r["system"] for r in ran], [r["of_ideal"] for r in ran],
                    color=["tab:orange" if r["vpipe"] else "tab:gray" for r in ran])
            ax.set_title(f"{case['model']}, {case['stages']} stages")
            ax.set_xlabel("fraction of ideal throughput")
        axes[0][0].invert_yaxis()
        written.append(_save(fig, directory / "throughput.png"))
    if "microbatch" in results:
        cases = results["microbatch"]["cases"]
        fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 4), sharey=True, squeeze=False)
        for ax, case in zip(axes[0], cases):
            ax.barh([r["system"] for r in case["rows"]], [r["max_micro_batch_size"] for r in case["rows"]],
                    color=["tab:orange" if r["vpipe"] else "tab:gray" for r in case["rows"]])
            ax.set_title(f"{case['model']}, {case['stages']} stages")
            ax.set_xlabel("largest micro-batch under the budget")
        axes[0][0].invert_yaxis()
        written.append(_save(fig, directory / "microbatch.png"))
    projection = results.get("simulator", {}).get("projection", [])
    if projection:
        ratio = projection[0]["ratio"]
        rows = [r for r in projection if r["ratio"] == ratio]
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in rows[0]["systems"]:
            ax.plot([r["stages"] for r in rows], [r["systems"][name]["of_ideal"] for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("stages (one GPU-like device each)")
        ax.set_ylabel("fraction of ideal throughput")
        ax.set_title(f"simulated: block compute = {ratio:g} x its PCIe round trip")
        ax.legend()
        written.append(_save(fig, directory / "projection.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vpipe.report", description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="?", default="docs/results", help="directory of NAME.json (default docs/results)")
    p.add_argument("--readme", default=None, help="rewrite its headline table (between the headline markers)")
    p.add_argument("--docs", default=None, help="rewrite its full tables (between the results markers)")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here (needs matplotlib)")
    args = p.parse_args(argv)
    try:
        results = load_results(Path(args.results))
        if args.readme:
            path = Path(args.readme)
            path.write_text(replace_between(path.read_text(), "headline", headline_markdown(results)))
        if args.docs:
            path = Path(args.docs)
            path.write_text(replace_between(path.read_text(), "results", results_markdown(results)))
        written = plot(results, Path(args.plots)) if args.plots else []
    except ValueError as e:
        print(f"vpipe.report: error: {e}", file=sys.stderr)
        return 2
    if not (args.readme or args.docs or args.plots):
        print(headline_markdown(results))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
