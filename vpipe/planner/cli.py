"""``vpipe plan``: plan a layer graph, or a model, offline and print
the plan (a table, or JSON with ``--json``).

``vpipe plan GRAPH.json`` plans a layer graph (``docs/graph-format.md``) and names layers by
id. ``vpipe plan --model MODULE:FACTORY`` builds the graph itself: it measures the model's
blocks and other modules on this machine (:mod:`vpipe.profiling`), plans it,
and prints the plan in the model's terms (:mod:`vpipe.planner.model_plan`): module names
per stage, a ``split_spec`` for ``torch.distributed.pipelining.pipeline``, blocks per
stage for a manual split, each module's policy.

Every problem with the input (unreadable or invalid graph, a factory that cannot be
imported or fails, bad shapes, bad numbers, a budget no plan fits) ends the command with
exit status 2 and one line ``vpipe: error: ...``; argument errors too, so scripts get the
same one-line diagnostics whatever went wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

from vpipe.graph import LayerGraph, ModelGraph, load_graph
from vpipe.plan import Policy
from vpipe.planner.cost_model import MULTI_STAGE, SCHEDULES, GraphProfile, Hardware
from vpipe.planner.formats import deepspeed_form, format_lines, megatron_form, torchtitan_form
from vpipe.planner.model_plan import ModelPlan, model_plan
from vpipe.planner.srp import METHODS, PlanResult, plan_pipeline
from vpipe.sizes import parse_bytes as _parse_size

__all__ = ["register", "parse_bytes", "cmd_plan"]

def parse_bytes(text: str) -> int:
    """A memory budget as the user typed it (see :mod:`vpipe.sizes`)."""
    return _parse_size(text, what="memory budget")


def _positive_int(what: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}")
    return value


def _positive_float(what: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{what} must be a positive finite number, got {text!r}")
    return value


# bytes/s: below a modem, above any link; outside, plans are nonsense
_MIN_BANDWIDTH, _MAX_BANDWIDTH = 1e3, 1e15


def _bandwidth(what: str, text: str) -> float:
    value = _positive_float(what, text)
    if not _MIN_BANDWIDTH <= value <= _MAX_BANDWIDTH:
        raise ValueError(f"{what} must be between {_MIN_BANDWIDTH:g} and {_MAX_BANDWIDTH:g} "
                         f"bytes/s, got {text!r}")
    return value


def _one_line_error(message: str) -> NoReturn:
    print(f"vpipe: error: {message}", file=sys.stderr)
    sys.exit(2)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to the ``vpipe`` parser."""
    p = subparsers.add_parser(
        "plan", help="plan a layer graph or a model onto pipeline stages (partition + "
                     "swap/recompute policies)",
        description="Partition GRAPH.json, or the model a factory builds (--model), into contiguous pipeline "
                    "stages and choose each layer's keep (D) / swap (S) / recompute (R) policy "
                    "(vPipe's SRP search).")
    p.error = _one_line_error  # one line, never a usage dump
    p.add_argument("graph", metavar="GRAPH.json", nargs="?", default=None,
                   help="layer graph (docs/graph-format.md); or use --model")
    p.add_argument("--model", metavar="MODULE:FACTORY", default=None,
                   help="plan a model: FACTORY() in MODULE (a module name or a .py file) returns an "
                        "nn.Module, or (module, example input); its blocks and modules are measured on this "
                        "machine. The module's code runs here, as python FILE would run it: name only code "
                        "you trust")
    p.add_argument("--input-shape", metavar="DIMS", default=None,
                   help="--model: one micro-batch's input shape, e.g. 8,1024 (for a factory "
                        "returning only a model)")
    p.add_argument("--input-dtype", metavar="DTYPE", default=None,
                   help="--model: the input's dtype, e.g. int64 for token ids (default float32)")
    p.add_argument("--device", default="auto",
                   help="--model: where to measure: cpu, cuda, cuda:N, or auto (cuda if "
                        "there is one; default)")
    p.add_argument("--layers", metavar="PATH[,PATH]", default=None,
                   help="--model: the containers of repeated blocks (dotted paths); found when not given")
    p.add_argument("--repeats", default="3", metavar="N",
                   help="--model: timed runs per module, median (default 3)")
    p.add_argument("--save-graph", metavar="GRAPH.json", default=None,
                   help="--model: also write the measured layer graph here (vpipe plan reads it back)")
    p.add_argument("--stages", required=True, metavar="P",
                   help="pipeline ranks: one stage each, or --stages-per-rank under a multi-stage schedule")
    p.add_argument("--stages-per-rank", default=None, metavar="V",
                   help="virtual stages per rank under a multi-stage schedule (default 2; "
                        "zbv, dualpipev: 2); the plan has P x V stages")
    p.add_argument("--memory-budget", metavar="BYTES", default=None,
                   help="device memory per stage, e.g. 16e9, 16GB, 15GiB, or one per stage: 8GB,8GB,12GB")
    p.add_argument("--schedule", default="1f1b",
                   help=f"one of {', '.join(SCHEDULES + _PLANNABLE_MULTI)} (default 1f1b)")
    p.add_argument("--micro-batches", default="8", metavar="M", help="micro-batches per step (default 8)")
    p.add_argument("--method", default="kl", help="kl (vPipe's Alg. 3, default) or exact (optimal DP)")
    p.add_argument("--copy-bandwidth", default=None, metavar="BYTES_PER_S",
                   help=f"device-host copy link for swaps (default {Hardware().copy_bytes_per_s:.3g})")
    p.add_argument("--network-bandwidth", default=None, metavar="BYTES_PER_S",
                   help=f"link between neighbouring stages (default {Hardware().net_bytes_per_s:.3g})")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)
    return p


# "custom" is a run's own action list; "wpipe" (vpipe's ScheduleWPipe) is planned with the lists it writes
_PLANNABLE_MULTI = tuple(s for s in MULTI_STAGE if s != "custom")


def _budget(text: str | None) -> int | list[int] | None:
    if text is None:
        return None
    parts = [parse_bytes(part) for part in text.split(",")]
    return parts[0] if len(parts) == 1 else parts


def cmd_plan(args: argparse.Namespace, argv: object = None) -> int:
    if (args.graph is None) == (args.model is None):
        raise ValueError("give either GRAPH.json or --model MODULE:FACTORY" if args.graph is None else
                         "give GRAPH.json or --model MODULE:FACTORY, not both")
    ranks = _positive_int("--stages", args.stages)
    micro_batches = _positive_int("--micro-batches", args.micro_batches)
    if args.schedule not in SCHEDULES + _PLANNABLE_MULTI:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES + _PLANNABLE_MULTI)}, "
                         f"got {args.schedule!r}")
    per_rank = _stages_per_rank(args.schedule, args.stages_per_rank)
    stages = ranks * per_rank
    if args.method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {args.method!r}")
    budget = _budget(args.memory_budget)
    defaults = Hardware()
    hardware = Hardware(
        copy_bytes_per_s=(_bandwidth("--copy-bandwidth", args.copy_bandwidth)
                          if args.copy_bandwidth is not None else defaults.copy_bytes_per_s),
        net_bytes_per_s=(_bandwidth("--network-bandwidth", args.network_bandwidth)
                         if args.network_bandwidth is not None else defaults.net_bytes_per_s),
    )
    if args.model is None:
        for flag in ("input_shape", "input_dtype", "layers", "save_graph"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} is for --model")
        graph, model_graph = load_graph(args.graph)  # a graph --save-graph wrote plans in module names
        if stages > len(graph):
            raise ValueError(f"{_stages_text(ranks, per_rank)} is more than the graph's {len(graph)} layers")
    else:
        model_graph = _measure_model(args)
        graph = model_graph.graph
        if stages > len(graph):
            raise ValueError(f"{_stages_text(ranks, per_rank)} is more than the model's "
                             f"{len(graph)} placement units ({_names(model_graph)})")
    layout = _layout(args.schedule, ranks, per_rank, micro_batches)
    result = plan_pipeline(graph, stages, schedule=args.schedule, micro_batches=micro_batches,
                           memory_budget=budget, method=args.method, hardware=hardware,
                           in_flight_counts=None if layout is None else layout.in_flight,
                           stage_ranks=None if layout is None else layout.stage_ranks)
    extra = {} if layout is None else {"stage_ranks": layout.stage_ranks, "in_flight": layout.in_flight}
    if model_graph is not None:
        plan = model_plan(model_graph, result, hardware)
        forms = {"torchtitan": torchtitan_form(plan.stages, model_graph.units, args.schedule, ranks,
                                               per_rank),
                 "megatron": megatron_form(plan.stages, model_graph.units, args.schedule, ranks),
                 "deepspeed": deepspeed_form(plan.stages, model_graph.units, args.schedule, per_rank)}
        if args.json:
            print(json.dumps({**plan.summary(), "device": model_graph.device, **extra, **forms}))
        else:
            _print_model_table(model_graph, plan, args,
                               _rank_lines(layout) + format_lines(forms["torchtitan"], forms["megatron"],
                                                                    forms["deepspeed"]))
    elif args.json:
        print(json.dumps({**result.summary(), **extra}))
    else:
        _print_table(graph, result, args)
        print("\n".join(_rank_lines(layout)))
    return 0


def _rank_lines(layout: Any) -> list[str]:
    if layout is None:
        return []
    return (["stage ranks (rank of stage 0, 1, ...): "
             f"{','.join(map(str, layout.stage_ranks))}; micro-batches in "
            f"flight at each stage's peak: {','.join(map(str, layout.in_flight))}"])


def _stages_per_rank(schedule: str, text: str | None) -> int:
    """Virtual stages per rank, as ``vpipe train`` and torch's schedules count them."""
    if schedule not in _PLANNABLE_MULTI:
        if text is not None:
            raise ValueError("--stages-per-rank is for the multi-stage schedules "
                             f"({', '.join(_PLANNABLE_MULTI)}); {schedule} runs one stage per rank")
        return 1
    if text is None:
        return 2
    per_rank = _positive_int("--stages-per-rank", text)
    if per_rank < 2:
        raise ValueError(f"--stages-per-rank must be at least 2 under {schedule}, got "
                         f"{per_rank} (1f1b runs one stage per rank)")
    if schedule in ("zbv", "dualpipev", "wpipe") and per_rank != 2:
        shape = "G0's and G1's" if schedule == "wpipe" else "a V"
        raise ValueError(f"{schedule} runs exactly 2 stages per rank ({shape}), "
                         f"got --stages-per-rank {per_rank}")
    return per_rank


def _stages_text(ranks: int, per_rank: int) -> str:
    return f"--stages {ranks}" if per_rank == 1 else f"--stages {ranks} x --stages-per-rank {per_rank}"


def _layout(schedule: str, ranks: int, per_rank: int, micro_batches: int) -> Any:
    """A multi-stage schedule's stage ranks and in-flight counts, read off torch's action lists as the ranks
    read them (torch loads here, and only for a multi-stage schedule); None for a single-stage one."""
    if per_rank == 1:
        return None
    from vpipe.profiling.schedule_layout import schedule_layout

    return schedule_layout(schedule, ranks, per_rank, micro_batches)


def _measure_model(args: argparse.Namespace) -> ModelGraph:
    """Measure the factory's model (torch loads here, and only for ``--model``)."""
    repeats = _positive_int("--repeats", args.repeats)
    from vpipe.profiling.command import measure_model

    return measure_model(args.model, shape=args.input_shape, dtype=args.input_dtype, device=args.device,
                         repeats=repeats, layers=args.layers, save_graph=args.save_graph)


def _names(model_graph: ModelGraph) -> str:
    names = [u.name for u in model_graph.units]
    return ", ".join(names) if len(names) <= 8 else ", ".join(names[:4] + ["..."] + names[-2:])


def _print_table(graph: LayerGraph, result: PlanResult, args: argparse.Namespace) -> None:
    profile = GraphProfile(graph)
    rows, end = [], 0
    for k, layers in enumerate(result.stages):
        end += len(layers)
        swaps = sum(1 for lid in layers if result.policies[lid] is Policy.SWAP)
        recomputes = sum(1 for lid in layers if result.policies[lid] is Policy.RECOMPUTE)
        out_bytes = profile.cut[end] if end < profile.n else 0.0
        rows.append([str(k), str(len(layers)), f"{layers[0]}..{layers[-1]}",
                     f"{result.stage_times_s[k] * 1e3:.3f}",
                     _human(result.stage_memory_bytes[k]), str(swaps), str(recomputes), _human(out_bytes)])
    print(text_table(f"{getattr(graph, 'name', 'graph')}: {len(result.stages)} stages, {args.schedule}, "
                     f"{args.micro_batches} micro-batches, method {result.method}",
                     ["stage", "layers", "ids", "time ms", "memory", "swap", "recompute", "boundary out"],
                     rows,
                     left={"ids"}))
    print(f"slowest stage {result.bottleneck_s * 1e3:.3f} ms, step {result.step_s * 1e3:.3f} ms "
          f"(bubble included), boundary bytes {result.comm_bytes:,}, planned in "
          f"{result.planner_s * 1e3:.1f} ms ({result.iterations} SRP iteration(s))")


def text_table(title: str, columns: list[str], rows: list[list[str]], *,
               left: frozenset[str] | set[str] = frozenset()) -> str:
    """A plain-text table, columns padded to fit and never wrapped (plans are pasted from it)."""
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]

    def line(cells: list[str]) -> str:
        padded = (c.ljust(w) if name in left else c.rjust(w) for c, w, name in zip(cells, widths, columns))
        return " | ".join(padded).rstrip()

    return "\n".join([title, line(columns), "-+-".join("-" * w for w in widths), *map(line, rows)])


def _human(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


def _compact(names: list[str], containers: dict[str, str | None]) -> str:
    """Module names with runs of blocks of one container written ``path.first..last``."""
    parts: list[str] = []
    i = 0
    while i < len(names):
        container = containers.get(names[i])
        j = i
        while j + 1 < len(names) and container is not None and containers.get(names[j + 1]) == container:
            j += 1
        if j - i >= 2:
            prefix = f"{container}." if container else ""
            parts.append(f"{names[i]}..{names[j][len(prefix):]}")
        else:
            parts.extend(names[i:j + 1])
        i = j + 1
    return ", ".join(parts)


def _print_model_table(mg: ModelGraph, pl: ModelPlan, args: argparse.Namespace, forms: list[str]) -> None:
    containers = {u.name: u.container for u in mg.units}
    rows = [[str(k), _compact(names, containers), f"{pl.stage_s[k] * 1e3:.3f}",
             _human(pl.stage_memory_bytes[k]),
             "".join(pl.policies[n] for n in names)] for k, names in enumerate(pl.stages)]
    print(
        text_table(
            f"{args.model or mg.source or args.graph}: {len(pl.stages)} stages, {args.schedule}, "
            f"{args.micro_batches} micro-batches, measured on {mg.device or '?'}, method {pl.method}",
            ["stage", "modules", "time ms", "memory", "policies"],
            rows,
            left={"modules", "policies"},
        )
    )
    parts = pl.bottleneck
    lines = [
        f"predicted step {pl.step_s * 1e3:.3f} ms (bubble included); slowest stage {pl.bottleneck_stage}: "
        f"{parts['total'] * 1e3:.3f} ms = compute {parts['compute'] * 1e3:.3f} + transfers "
        f"{parts['transfers'] * 1e3:.3f} + swaps {parts['swaps'] * 1e3:.3f}",
        "policies: D keep, S swap to host, R recompute; one letter per module, in order",
        f"split_spec for torch.distributed.pipelining.pipeline: {pl.split_spec_text()}",
    ]
    slowest = pl.stages[pl.bottleneck_stage]
    if len(slowest) == 1 and len(pl.stages) > 1:
        lines.append(f"the slowest stage is one module, {slowest[0]}: no split makes a "
                     "stage faster than it, so more stages do not shorten the step")
    for container, counts in pl.layer_counts.items():
        lines.append(f"blocks per stage for a manual split of {container or 'the model'}: "
                     f"{','.join(str(c) for c in counts)}")
    if mg.unused:
        lines.append(f"not called by the forward, so on no stage: {', '.join(mg.unused)}")
    lines += forms
    lines.append(f"planned in {pl.planner_s * 1e3:.1f} ms")
    print("\n".join(lines))  # plain lines, never wrapped: the split_spec is to be pasted
