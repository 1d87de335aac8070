"""``vpipe bench``: run the benchmarks in ``benchmarks/`` by name, each at its default size.

Every benchmark is a script that follows one convention: ``python benchmarks/X.py --json
OUT`` runs its default size, prints a rich table and writes its numbers to ``OUT``; its
``main(argv: list[str] | None) -> int`` does the same from Python. This module only knows
the names, runs each script in its own process (so one crashing or leaking threads
cannot disturb the next) and records how long each took.

Where the results go (``--json OUT``):

- one NAME and ``OUT`` ending in ``.json``: that benchmark's JSON is written to ``OUT``;
- otherwise ``OUT`` is a directory: ``OUT/NAME.json`` per benchmark, plus
  ``OUT/bench.json`` with each benchmark's status (ok, failed, skipped and why) and wall
  seconds. ``vpipe_lab.report`` reads such a directory to regenerate the README's headline
  table and the plots in ``docs/``.

A script writes its JSON into a private temporary directory; vpipe then puts it in place
with the safe writer (``vpipe.files``), so a link planted at ``OUT`` or in it is refused in
one line (a script's own ``write_text`` would have followed it).

Benchmarks that other work provides (``nas``, ``soak``) are skipped with the reason
printed when their script is not in this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from vpipe.files import make_dirs, read_regular, write_output
from vpipe.output_paths import check_output_file

__all__ = ["Benchmark", "BENCHMARKS", "run_benchmarks", "register"]

SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the checkout, when vpipe runs from one


def default_benchmarks_dir() -> Path:
    """``benchmarks/`` of the source checkout vpipe runs from, else of the current directory."""
    beside = SOURCE_ROOT / "benchmarks"
    return beside if beside.is_dir() else Path.cwd() / "benchmarks"


@dataclass(frozen=True)
class Benchmark:
    """One registered benchmark: its script under ``benchmarks/`` and what it measures."""

    name: str
    script: str
    about: str
    args: tuple[str, ...] = ()  # the default size, when it differs from the script's own defaults

    def script_in(self, folder: Path) -> Path:
        return folder / self.script


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "throughput",
            "throughput_bench.py",
            "samples/s of GPipe / 1F1B / PipeDream / Interleaved 1F1B / ZBV with and without vpipe under one "
            "memory budget, vs ideal",
            ("--rounds", "2"),
        ),
        Benchmark(
            "microbatch",
            "microbatch_bench.py",
            "the largest micro-batch each system trains under a fixed per-stage budget",
            ("--cases", "transformer:2,cnn:2"),
        ),
        Benchmark(
            "planner",
            "planner_bench.py",
            "planner time and gap to the exact optimum, 4-128 stages, vs networkx's plain KL",
            ("--repeats", "3"),
        ),
        Benchmark(
            "simulator",
            "simulator_bench.py",
            "the pipeline simulator vs real 2- and 4-stage runs, then projected to 8-64 stages and GPU costs",
        ),
        Benchmark(
            "migration",
            "migration_bench.py",
            "a live layer move vs stop-and-copy vs restart from a checkpoint",
            ("--steps", "22", "--restarts", "1"),
        ),
        Benchmark(
            "nas",
            "nas_rebalance.py",
            "a NAS edit (8 blocks added to stage 0): static vs vpipe vs the optimal static "
            "partition, per phase",
        ),
        Benchmark(
            "memory",
            "memory_budget.py",
            "a budget plain 1F1B exceeds: vpipe within it vs GPipe with full recompute",
        ),
        Benchmark(
            "shapes",
            "shapes_bench.py",
            "the one line on the tutorial, Sequential-slice and Hugging Face trainers: a "
            "6,2 split rebalanced vs the hand-balanced 4,4",
        ),
        Benchmark(
            "overhead",
            "overhead_bench.py",
            "attaching vpipe to a balanced 2-stage pipeline that fits: plain vs attached "
            "vs planning, 2 sizes",
        ),
        Benchmark(
            "deepspeed",
            "deepspeed_balance.py",
            "DeepSpeed's pipeline engine alone vs with vpipe.attach(engine), side by side: a "
            "uniform split whose first stage does three times the second's work (needs the deepspeed extra)",
        ),
        Benchmark(
            "dynamic",
            "dynamic_bench.py",
            "dynamic workloads (a slower rank, a straggler, freezing, a growing sequence, a "
            "NAS edit): vpipe vs plain copies at the same and the best static split, side by side; reaction "
            "steps, moves, losses",
        ),
        Benchmark(
            "schedules",
            "schedule_bench.py",
            "time per step and memory per stage of GPipe, 1F1B, PipeDream, PipeDream-2BW "
            "and WPipe on 4 stages, side by side in one launch",
        ),
        Benchmark(
            "soak",
            "soak.py",
            "thousands of steps of forced moves and policy changes: RSS growth, parameters vs the reference",
        ),
    )
}


def run_benchmarks(names: list[str], out: Path | None, *, folder: Path | None = None,
                   extra: list[str] | None = None) -> list[dict[str, Any]]:
    """Run ``names`` from ``folder`` (default: :func:`default_benchmarks_dir`) in order; return one status
    record per benchmark (also in ``out/bench.json``)."""
    folder = folder or default_benchmarks_dir()
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    single_file = out is not None and len(names) == 1 and out.suffix == ".json"
    if out is not None and not single_file:
        if out.exists() and not out.is_dir():
            raise ValueError(f"--json {out}: is a file; with {len(names)} benchmarks --json names a "
                             "directory for NAME.json and bench.json (a .json file only for one NAME)")
        try:
            make_dirs(out, "--json")  # 0700, never through a link another user planted
        except OSError as e:
            raise ValueError(f"--json {out}: cannot make the directory: {e.strerror or e}") from None
    targets = {name: out if single_file else (out / f"{name}.json" if out is not None else None)
               for name in names}
    for target in filter(None, [*targets.values(), out / "bench.json" if out and not single_file else None]):
        # a link planted there is said now, not after an hour of benchmarks
        check_output_file(target, "--json")
    records = []
    for name in names:
        records.append(_run_one(BENCHMARKS[name], folder, targets[name], extra or []))
        print(f"vpipe bench: {name}: {records[-1]['status']} ({records[-1]['seconds']:.0f} s)"
              + (f": {records[-1]['reason']}" if records[-1].get("reason") else ""), flush=True)
    if out is not None and not single_file:
        status = {"benchmarks": records, "total_s": sum(r["seconds"] for r in records)}
        write_output(out / "bench.json", json.dumps(status, indent=1).encode(), "--json")
    return records


def _run_one(bench: Benchmark, folder: Path, target: Path | None, extra: list[str]) -> dict[str, Any]:
    """Run one benchmark; its JSON (written by the script into a private temporary directory) is put at
    ``target`` by the safe writer."""
    if target is None:
        return _run_script(bench, folder, None, extra)
    with tempfile.TemporaryDirectory(prefix="vpipe-bench-") as private:  # 0700: nobody else can plant a link
        written = Path(private) / target.name
        record = _run_script(bench, folder, written, extra)
        if written.exists():
            write_output(target, read_regular(written, 1 << 30, "benchmark JSON"), "--json")
        if record.get("json"):
            record["json"] = str(target)
        if "command" in record:  # as the user would run it
            record["command"] = record["command"].replace(str(written), str(target))
        return record


def _run_script(bench: Benchmark, folder: Path, target: Path | None, extra: list[str]) -> dict[str, Any]:
    record: dict[str, Any] = {"name": bench.name, "script": f"benchmarks/{bench.script}", "seconds": 0.0}
    script = bench.script_in(folder)
    if not script.exists():
        return {**record, "status": "skipped", "reason": f"benchmarks/{bench.script} is not in {folder}"}
    argv = [sys.executable, str(script), *bench.args, *extra]
    if target is not None:
        argv += ["--json", str(target)]
    record["command"] = " ".join(["python", f"benchmarks/{bench.script}", *argv[2:]])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    print(f"\nvpipe bench: {bench.name}: {bench.about}", flush=True)
    started = time.perf_counter()
    code = subprocess.call(argv, cwd=folder.parent, env=env)
    record["seconds"] = time.perf_counter() - started
    if code != 0:
        return {**record, "status": "failed", "reason": f"exit status {code}"}
    return {**record, "status": "ok", "json": str(target) if target else None}


def register(subparsers: Any) -> None:
    """Add ``vpipe bench`` to the CLI."""
    names = ", ".join(f"{b.name} ({b.about})" for b in BENCHMARKS.values())
    p = subparsers.add_parser("bench", help="run the benchmarks (all, or those named) and write their JSON",
                              description=f"Benchmarks: {names}.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="benchmarks to run (default: all, at default size)")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="directory for NAME.json per benchmark and bench.json (or a .json file for one NAME)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--benchmarks", default=None, metavar="DIR",
                   help="the benchmarks/ folder of a vpipe source checkout (default: the "
                        "checkout vpipe runs from, else ./benchmarks)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace, argv: Any = None) -> int:
    folder = Path(args.benchmarks) if args.benchmarks else default_benchmarks_dir()
    if args.list:
        for b in BENCHMARKS.values():
            present = "" if b.script_in(folder).exists() else f"  (not in {folder})"
            print(f"{b.name:11} benchmarks/{b.script}: {b.about}{present}")
        return 0
    names = args.names or list(BENCHMARKS)
    if not folder.is_dir():
        raise ValueError("vpipe bench runs the scripts of a vpipe source checkout's benchmarks/ folder, and "
                         f"{folder} is not one: run it from the checkout or pass --benchmarks DIR")
    started = time.perf_counter()
    records = run_benchmarks(names, Path(args.json) if args.json else None, folder=folder)
    _print_summary(records, time.perf_counter() - started)
    return 1 if any(r["status"] == "failed" for r in records) else 0


def _print_summary(records: list[dict[str, Any]], total_s: float) -> None:
    table = Table(title=f"vpipe bench: {total_s:.0f} s in all")
    for col in ("benchmark", "status", "seconds", "note"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    for r in records:
        table.add_row(r["name"], r["status"], f"{r['seconds']:.0f}", r.get("reason", ""))
    Console().print(table)
