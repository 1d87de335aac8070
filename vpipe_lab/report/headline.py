"""The README's headline table: one row per benchmark that has results, vpipe against its baseline."""

from __future__ import annotations

import statistics
from typing import Any

from vpipe_lab.report.markdown import ratio, steps, table
from vpipe_lab.report.results import Results

__all__ = ["headline_rows", "headline_markdown"]


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
                         f"{best_b['system']}: {best_b['samples_per_s']:.0f} samples/s "
                         f"({best_b['of_ideal']:.0%})",
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
                     f"predicted {r['predicted_s'] * 1e3:.0f} ms/step",
                     f"measured {r['measured_s'] * 1e3:.0f} ms",
                     f"{r['error']:+.1%}"])
    migration = results.get("migration", {})
    mig = {r["method"]: r for r in migration.get("rows", [])}
    live, sac = mig.get("live (vpipe)"), mig.get("stop-and-copy")
    if live and sac:
        live_stall = max(live["stall_ratio"], migration["live_boundary_ratio"])
        rows.append(["repartition cost, 2 stages (stall / step)",
                     f"live move: {live['stall_ratio']:.1%} (the move itself "
                     f"{migration['live_boundary_ratio']:.1%})",
                     f"stop-and-copy: {sac['stall_ratio']:.0%}",
                     f"{sac['stall_ratio'] / live_stall:.0f}x less"])
    nas = results.get("nas", {})
    if nas.get("per_round"):
        after = {name: statistics.median(r["throughput"][name]["after"] for r in nas["per_round"])
                 for name in ("static", "vpipe")}
        rows.append(["NAS edit: 8 blocks added to stage 0 of 2, throughput after it",
                     f"vpipe: {after['vpipe']:.0f} samples/s "
                     f"({nas['vpipe_over_optimal_after']['median']:.0%} of the optimal static partition; per "
                     f"round, 90% of it reached after: {steps(nas['recovery_steps'])})",
                     f"static: {after['static']:.0f} samples/s "
                     f"({nas['static_over_optimal_after']['median']:.0%} of optimal)",
                     ratio(nas["vpipe_over_static_after"])])
    memory = results.get("memory", {})
    if memory.get("samples_per_s"):
        fits = memory["within_budget"]
        rows.append([f"a {memory['budget_bytes'] / 2**20:.0f} MiB/stage budget plain 1F1B exceeds (2 stages)",
                     f"1F1B + vpipe: {memory['samples_per_s']['vpipe']:.0f} samples/s, "
                     f"{'within' if fits['vpipe'] else 'OVER'} budget",
                     f"GPipe, all recomputed: {memory['samples_per_s']['gpipe_recompute']:.0f} samples/s",
                     ratio(memory["vpipe_over_recompute"])])
    shapes = results.get("shapes", {}).get("rows", [])
    if shapes:
        worst = max(shapes, key=lambda r: r["vpipe_over_balanced"])
        rows.append(["the one line on users' trainers "
                     f"({', '.join(r['shape'] for r in shapes)}), 6,2 split on 2 stages",
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
                         f"pinned pool: {pool:.1f} GB/s, {swap['overlap']['overlap']:.0%} "
                         "hidden under compute",
                         f"`.cpu()`: {pageable:.1f} GB/s", f"{pool / pageable:.0f}x"])
    return rows


def headline_markdown(results: Results) -> str:
    rows = headline_rows(results)
    if not rows:
        return "_No benchmark results yet: run `vpipe bench --json docs/results`._"
    return (table(["result", "vpipe", "baseline", "vpipe vs baseline"], rows)
            + "\n\nFrom `docs/results/*.json` (2-core shared CPU; the GPU row from the card it names, "
              "`docs/results/gpu/`), regenerated by "
              "`python -m vpipe_lab.report`; details in [docs/benchmarks.md](docs/benchmarks.md).")


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
            f"slowest plan {slowest['kl_s_median'] * 1e3:.0f} ms ({slowest['graph']}, "
            f"{slowest['stages']} stages)",
            f"networkx KL, {big['graph']} on {big['stages']} stages: {big['nx_s'] * 1e3:.0f} ms, gap "
            f"{big['nx_gap']:+.0%}, {'valid' if big['nx_valid'] else 'not a valid pipeline'}" if "nx_s" in big
            else "-",
            f"{big['nx_s'] / big['kl_s_median']:.1f}x faster" if "nx_s" in big else "-"]
