"""The full tables of ``docs/benchmarks.md``: one section per benchmark, rendered from its JSON.

:data:`SECTIONS` names each benchmark's section title and renderer, in the order the
docs show them; results with no section are listed by name, and ``bench.json`` (the
run's status) closes the page.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from vpipe_lab.report.markdown import ratio, steps, table
from vpipe_lab.report.results import Results

__all__ = ["SECTIONS", "results_markdown"]


def _throughput_md(data: dict[str, Any]) -> str:
    parts = []
    for case in data["cases"]:
        rows = []
        for r in case["rows"]:
            if not r.get("samples_per_s"):
                rows.append([r["system"], "-", "does not fit", "", "", ""])
                continue
            rows.append([r["system"], f"{r['micro_batch_size']} x {r['micro_batches']}",
                         f"{r['samples_per_s']:.1f}",
                         ratio(r.get("vs_without_vpipe")), ratio(r.get("vs_gpipe")), f"{r['of_ideal']:.0%}"])
        virtual = (f" ({case['virtual_partition']} on the virtual stages)" if case.get("virtual_partition")
                   else "")
        parts.append(f"**{case['model']} on {case['stages']} stages**: budget "
                     f"{case['budget_bytes'] / 2**20:.1f} MiB "
                     f"per rank, global batch {case['global_batch']}, partition "
                     f"{case['partition']}{virtual}, ideal {case['ideal_samples_per_s']:.0f} samples/s\n\n"
                     + table(["system", "mb x n", "samples/s", "vs without vpipe", "vs GPipe (all R)",
                              "of ideal"],
                              rows))
    return "\n\n".join(parts)


def _microbatch_md(data: dict[str, Any]) -> str:
    parts = []
    for case in data["cases"]:
        rows = [[r["system"], (">= " if r["capped"] else "") + str(r["max_micro_batch_size"]),
                 "-" if r["vs_pipedream"] is None else f"{r['vs_pipedream']:.2f}x",
                 " \\| ".join(r["policies"] or [])]
                for r in case["rows"]]
        parts.append(f"**{case['model']} on {case['stages']} stages**, {case['micro_batches']} "
                     "micro-batches, budget "
                     f"{case['budget_bytes'] / 2**20:.1f} MiB per stage ({case['budget_rule']})\n\n"
                     + table(["system", "max micro-batch", "vs PipeDream", "vpipe's policies at max"], rows))
    return "\n\n".join(parts)


def _planner_md(data: dict[str, Any]) -> str:
    rows = [[r["graph"], str(r["nodes"]), str(r["stages"]), f"{r['kl_s_median'] * 1e3:.0f}",
             f"{r['kl_gap']:+.2%}",
             f"{r['exact_s'] * 1e3:.0f}", f"{r['nx_s'] * 1e3:.0f}" if "nx_s" in r else "-",
             ("yes" if r["nx_valid"] else "no") if "nx_valid" in r else "-",
             f"{r['nx_gap']:+.0%}" if "nx_gap" in r else "-"] for r in data["rows"]]
    return table(["graph", "nodes", "stages", "vpipe ms", "gap to exact", "exact ms", "networkx KL ms",
                   "KL valid pipeline", "KL gap"], rows)


def _simulator_md(data: dict[str, Any]) -> str:
    parts = []
    if data.get("validation"):
        rows = [[str(r["stages"]), r["schedule"], f"{r['predicted_s'] * 1e3:.0f}",
                 f"{r['measured_s'] * 1e3:.0f}",
                 f"{r['error']:+.1%}", f"{r['background']:.1f}", f"{r['action_overhead_s'] * 1e3:.2f}",
                 f"{r.get('compute_scale', 1.0):.2f}", str(r.get("calibrated_on_stages") or r["stages"])]
                for r in data["validation"]]
        parts.append("Validation against real runs on this machine:\n\n" + table(
            ["stages", "schedule", "predicted ms", "measured ms", "error", "outside load (runnable threads)",
             "calibrated overhead per action (ms)", "calibrated compute scale", "calibrated on (stages)"],
                                                                                 rows))
    systems = list(data["projection"][0]["systems"]) if data.get("projection") else []
    rows = [[str(r["stages"]), f"{r['ratio']:g}", f"{r['speedup']:.0f}x",
             *(f"{r['systems'][n]['of_ideal']:.0%}" for n in systems)]
            for r in data.get("projection", [])]
    if rows:
        link = data["link"]
        parts.append(f"Projection (fraction of ideal; PCIe {link['swap_bytes_per_s'] / 1e9:g} GB/s swaps "
                     f"overlapped with compute, {link['send_bytes_per_s'] / 1e9:g} GB/s between stages):\n\n"
                     + table(["stages", "block compute / PCIe round trip", "compute speedup over this CPU",
                              *systems],
                              rows))
    return "\n\n".join(parts)


def _migration_md(data: dict[str, Any]) -> str:
    rows = [[r["method"], str(len(r["stalls_s"])), f"{r['stall_median_s'] * 1e3:.1f}",
             f"{r['stall_ratio']:.1%}",
             f"{r['step_s'] * 1e3:.0f}"] for r in data["rows"]]
    return table(["method", "moves", "stall median ms", "stall / step", "step ms"], rows)


def _nas_md(data: dict[str, Any]) -> str:
    rounds = data["per_round"]
    phases = ("before", "transition", "after")

    def med(name: str, phase: str) -> str:
        return f"{statistics.median(r['throughput'][name][phase] for r in rounds):.1f}"

    rows = [[name, *(med(name, ph) for ph in phases), ratio(data[f"{name}_over_optimal_after"]),
             steps([r["recovery_steps" if name == "vpipe" else "static_recovery_steps"] for r in rounds])]
            for name in ("static", "vpipe")]
    optimal = statistics.median(r["throughput"]["optimal"]["steady"] for r in rounds)
    rows.append([f"optimal static {data['config'].get('optimal_partition', '')}", "", "", f"{optimal:.1f}",
                 "1.00x",
                 ""])
    cfg = data["config"]
    return (f"{cfg['added']} blocks added to stage 0 of a {cfg['blocks']}-block transformer at "
            f"step {cfg['add_step']} "
            f"of {cfg['steps']} (2 stages, 1F1B), {len(rounds)} rounds; samples/s, median over rounds:\n\n"
            + table(["run", "before", "transition (30 steps)", "after", "after / optimal",
                      "steps to 90% of optimal"], rows)
            + f"\n\nvpipe / static after the edit: {ratio(data['vpipe_over_static_after'])}.")


def _memory_md(data: dict[str, Any]) -> str:
    mib = 2**20
    rows = [[name, f"{data['samples_per_s'][name]:.1f}" if name in data["samples_per_s"]
             else "not run (over budget)",
             ", ".join(f"{b / mib:.1f}" for b in footprints), "yes" if data["within_budget"][name] else "no"]
            for name, footprints in data["footprint_bytes"].items()]
    return (
        f"Budget {data['budget_bytes'] / mib:.0f} MiB per stage, 2 stages, micro-batch "
        f"{data['model']['micro_batch_size']}:\n\n"
        + table(["run", "samples/s", "stage footprints (MiB)", "within budget"], rows)
        + f"\n\nvpipe / GPipe with every layer recomputed: {ratio(data['vpipe_over_recompute'])}; vpipe's "
        f"policies per stage at the end (layer: policy): "
        f"{' / '.join(' '.join(f'{k}:{v}' for k, v in stage.items()) for stage in data['vpipe_policies'])}."
    )


def _shapes_md(data: dict[str, Any]) -> str:
    rows = [[r["shape"], f"{r['balanced_step_s'] * 1e3:.0f}", f"{r['uneven_step_s'] * 1e3:.0f}",
             f"{r['vpipe_step_s'] * 1e3:.0f}",
             f"{r['vpipe_over_balanced']:.2f}x ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})",
             f"{r['uneven_over_balanced']:.2f}x",
             ",".join(map(str, r["final_partition"])) + (f" at step {r['moved_at_step']}" if r["moved"]
                                                         else " (none)")]
            for r in data["rows"]]
    skipped = "".join(f" {name} skipped: {why}." for name, why in data.get("skipped", {}).items())
    return (f"2 CPU stages, 1F1B, {data['steps']} steps per run, median step of the last "
            f"{data['measure_steps']}, {data['rounds']} round(s) (runs alternate):\n\n"
            + table(["trainer", "4,4 plain ms", "6,2 plain ms", "6,2 + vpipe ms", "vpipe / 4,4", "6,2 / 4,4",
                      "vpipe's split"], rows) + skipped)


def _overhead_md(data: dict[str, Any]) -> str:
    def share(r: dict[str, Any]) -> str:
        return "-" if r.get("planner_cpu_share") is None else f"{r['planner_cpu_share']:.1%}"

    rows = [[r["size"], str(r["steps"]), f"{r['plain_step_s'] * 1e3:.1f}",
             f"{r['attached_step_s'] * 1e3:.1f}",
             f"{r['attached_over_plain']:.3f}x ({r['attached_range'][0]:.3f}-{r['attached_range'][1]:.3f})",
             f"{r['planned_step_s'] * 1e3:.1f}",
             f"{r['planned_over_plain']:.3f}x ({r['planned_range'][0]:.3f}-{r['planned_range'][1]:.3f})",
             share(r), str(r["plans_applied"]), {True: "yes", False: "no"}.get(r.get("same_losses"), "-")]
            for r in data["rows"]]
    text = ("The trainer of `examples/train_sequential.py` on 2 CPU stages split 4,4 (1F1B), run twice side "
            "by side in the same processes, a plain copy and one with the one line, stepped in ABBA order "
            f"on the same batches; {data['rounds']} launches of each kind: attached (`planning=False`) and "
            "planned (the one line's defaults). A launch's ratio is the vpipe copy's mean step over the "
            "plain copy's (second halves); median and range over launches. The planner daemon's CPU is a "
            "share of one core over the launch; \"same losses\": the two copies' losses were bitwise equal "
            "in every launch:\n\n"
            + table(["model", "steps per copy", "plain ms", "attached ms", "attached / plain", "planned ms",
                      "planned / plain", "planner CPU", "plans applied", "same losses"], rows))
    breakdown = data.get("breakdown")
    if breakdown:
        parts = [[str(r["rank"]), f"{r['step_s'] * 1e3:.1f}", f"{r['per_step_s']['step'] * 1e6:.0f}"]
                 + [f"{r['per_step_s'][g] * 1e6:.0f} ({r['calls_per_step'][g]:.0f} calls)"
                    for g in ("micro-batch", "layer call", "saved tensor")] for r in breakdown["ranks"]]
        text += ("\n\nWhere vpipe's own time goes, per step of the small attached run (microseconds, under "
                 f"cProfile, which inflates every Python call: upper bounds; {breakdown['steps']} steps, the "
                 "saved-tensor hooks run on the monitor's sampled steps only):\n\n"
                 + table(["rank", "step ms", "per step (boundary, monitor, control)", "per micro-batch",
                           "per layer call", "per saved tensor"], parts))
    return text


def _soak_md(data: dict[str, Any]) -> str:
    mib = 2**20
    rows = [[str(r["rank"]), str(r["plans_applied"]), f"{r['rss_first_bytes'] / mib:.1f}",
             f"{r['rss_mid_bytes'] / mib:.1f}", f"{r['rss_end_bytes'] / mib:.1f}",
             f"{r['rss_growth_second_half']:+.2%}", f"{r['pool_peak_bytes'] / 1024:.0f}",
             f"{r['pool_used_end_bytes'] / 1024:.0f}"] for r in data["ranks"]]
    return (f"{data['steps']} steps on 2 stages, a forced plan (partition and policies) every "
            f"{data['move_every']} steps ({data['forced_plans']} plans):\n\n"
            + table(["rank", "plans applied", "RSS start MiB", "RSS mid MiB", "RSS end MiB",
                     "growth 2nd half",
                      "host pool peak KiB", "host pool in use at end KiB"], rows)
            + f"\n\nFinal parameters equal the no-migration reference bit for bit: "
              f"{'yes' if data['params_equal_reference'] else 'NO'}; RSS growth target < "
              f"{data['rss_target']:.0%}.")


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
    others = sorted(name for name in set(results) - set(SECTIONS) - {"bench"} if not name.startswith("gpu_"))
    if others:
        parts.append("Other results in the directory (see their scripts): " + ", ".join(f"`{o}.json`"
                                                                                        for o in others))
    if "bench" in results:
        status = results["bench"]
        rows = [[r["name"], r["status"], f"{r['seconds']:.0f}", r.get("reason", "")]
                for r in status["benchmarks"]]
        parts.append(f"Run status (`bench.json`), {status['total_s']:.0f} s in all:\n\n"
                     + table(["benchmark", "status", "seconds", "note"], rows))
    return "\n\n".join(parts)
