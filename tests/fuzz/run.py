"""The fuzzer's command: draw trainers, run them in jobs of ranks,
report every outcome and how to reproduce it.

    python tests/fuzz/run.py --draws 300 --seed 0 [--fsdp-every 10] [--jobs-per-launch 40] [--json FILE]
    python tests/fuzz/run.py --only SEED          # one draw again, its log kept

Draws are grouped by rank count (2, or 4 for FSDP2 draws) into launches of ``--jobs-per-launch``
draws each, forked from a warm starter as ``tests/support/processes.py`` forks the test ranks. A job
that dies or hangs mid-draw costs that draw (an ERROR) and the rest are launched again. Exits
non-zero on any DIVERGED or ERROR. ``--library DIR`` runs another copy of vpipe (a directory holding
``vpipe/`` and ``vpipe_lab/``, e.g. ``git archive HEAD vpipe vpipe_lab | tar -x -C DIR``).
``--set AXIS=VALUE`` forces a value with its own constraints (tests/fuzz/constraints.py); a seed
that cannot take it is left out in one ``not run:`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
sys.path[:0] = [str(ROOT), str(TESTS)]

from fuzz.constraints import Unsupported  # noqa: E402
from fuzz.draws import FSDP_EVERY, draw, override  # noqa: E402
from fuzz.report import failures, print_summary, summary  # noqa: E402

PROGRAM = Path(__file__).resolve().parent / "rank_program.py"
FAILED = ("DIVERGED", "ERROR")
# a job with DeepSpeed draws first makes DeepSpeed's communication backend, which on a new machine builds
# its CPU op (2-4 minutes on 2 shared cores; 237 s here): outside every draw's timeout, inside the job's
DS_BUILD_S = 600


def rank_env(library: str | None) -> dict[str, str]:
    """A rank's environment: one thread, unbuffered, no inherited rank, ``fuzz`` importable,
    the library's copy first on the path when one is named."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed draws (engine=deepspeed) run on CPU
    env.pop("RANK", None)
    env.pop("VPIPE_LOG_FILE", None)  # each draw names its own log
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [library, str(ROOT), str(TESTS), env.get("PYTHONPATH")]))
    return env


def make_starter(env: dict[str, str]) -> Any:
    """A warm starter forking ranks with torch (and the library
    ``env`` names) imported; None where none can run."""
    from vpipe_lab.runtime.warm_start import WarmStarter, warm_start_possible

    return WarmStarter(env) if warm_start_possible([sys.executable, "-"], env) else None


def _tail(path: Path, stop: threading.Event, show: Callable[[dict[str, Any]], None]) -> None:
    """Show each result line of a running job as it appears."""
    offset = 0
    while True:
        done = stop.is_set()
        if path.exists():
            with path.open() as f:
                f.seek(offset)
                while (line := f.readline()).endswith("\n"):
                    offset += len(line.encode())
                    record = json.loads(line)
                    if record.get("event") == "result":
                        show(record)
        if done:
            return
        stop.wait(0.5)


def _read(path: Path) -> tuple[dict[int, dict[str, Any]], list[int]]:
    results, started = {}, []
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if record["event"] == "result":
                results[record["seed"]] = record
            else:
                started.append(record["seed"])
    return results, started


def run_launch(seeds: list[int], ranks: int, work: Path, *, env: dict[str, str], starter: Any,
               fsdp_every: int,
               draw_timeout: float, extra: Sequence[str], show: Callable[[dict[str, Any]], None],
               number: int) -> list[dict[str, Any]]:
    """Run ``seeds`` in jobs of ``ranks`` ranks until each has a result (a job that died costs its draw)."""
    from vpipe_lab.runtime.launch import spawn

    results: dict[int, dict[str, Any]] = {}
    pending = list(seeds)
    attempt = 0
    while pending:
        out, output = work / f"launch{number}-{attempt}.jsonl", work / f"launch{number}-{attempt}.txt"
        argv = [sys.executable, str(PROGRAM), "--out", str(out), "--logs", str(work / "logs"),
                "--seeds", ",".join(map(str, pending)), "--fsdp-every", str(fsdp_every),
                "--draw-timeout", str(draw_timeout), *extra]
        out.unlink(missing_ok=True)  # a work directory used before
        settings = [e.split("=", 1)[1] for e in extra if e.startswith("--set=")]
        drawn = [override(draw(s, fsdp_every), settings) for s in pending]
        stop = threading.Event()
        tail = threading.Thread(target=_tail, args=(out, stop, show), daemon=True)
        tail.start()
        code: Any
        try:
            with output.open("w") as sink:
                code = spawn(argv, ranks, extra_env=env, timeout_s=len(pending) * draw_timeout + 120
                             + (DS_BUILD_S if any(d.engine == "deepspeed" for d in drawn) else 0),
                             stdout=sink, stderr=sink, starter=starter, grace_s=10)
        except TimeoutError as e:
            code = f"timeout ({e})"
        finally:
            stop.set()
            tail.join()
        got, started = _read(out)
        results.update(got)
        pending = [s for s in pending if s not in results]
        if pending:
            lost = next((s for s in started if s not in got), pending[0])
            text = output.read_text()[-4000:] if output.exists() else ""
            record = {"seed": lost, "describe": draw(lost, fsdp_every).describe(), "ranks": ranks,
                      "outcome": "ERROR", "seconds": None, "error_phase": "job",
                      "signature": f"ERROR[job] the job ended during this draw (exit {code}; a hang past "
                                   "--draw-timeout ends it with every thread's stack)", "error": text,
                      "job_output": str(output)}
            show(record)
            results[lost] = record
            pending.remove(lost)
        attempt += 1
    return [results[s] for s in seeds]


def run_fuzz(seeds: Sequence[int], *, work: Path, fsdp_every: int = FSDP_EVERY, per_launch: int = 40,
             draw_timeout: float = 240.0, library: str | None = None, mixed_autodetect: bool = False,
             keep_logs: bool = False, settings: Sequence[str] = (), starter: Any = None,
             show: Callable[[dict[str, Any]], None] = lambda r: None) -> list[dict[str, Any]]:
    """Every seed's record, in the order given (2-rank launches first, then 4-rank ones)."""
    library = None if library is None else str(Path(library).resolve())
    env = rank_env(library)
    work = work.resolve()
    here = os.getcwd()
    # ``python -m`` puts the directory it starts in first on the path: the library's copy
    if library is not None:
        os.chdir(library)
    own = starter is None
    if own:
        starter = make_starter(env)
    extra = (["--mixed-autodetect"] if mixed_autodetect else []) + (["--keep-logs"] if keep_logs else [])
    extra += [f"--set={s}" for s in settings]
    by_ranks: dict[int, list[int]] = {}
    for s in seeds:
        # ``--set dp=none``
        by_ranks.setdefault(override(draw(s, fsdp_every), list(settings)).ranks, []).append(s)
    records: dict[int, dict[str, Any]] = {}
    number = 0
    try:
        for ranks in sorted(by_ranks):
            group = by_ranks[ranks]
            for i in range(0, len(group), per_launch):
                chunk = group[i:i + per_launch]
                for r in run_launch(chunk, ranks, work, env=env, starter=starter, fsdp_every=fsdp_every,
                                    draw_timeout=draw_timeout, extra=extra, show=show, number=number):
                    records[r["seed"]] = r
                number += 1
    finally:
        if own and starter is not None:
            starter.close()
        os.chdir(here)
    return [records[s] for s in seeds]


def _show(record: dict[str, Any]) -> None:
    seconds = record.get("seconds")
    took = f"{seconds:6.2f}s" if isinstance(seconds, (int, float)) else "     - "
    extra = "" if record["outcome"] in ("identical", "close",
                                        "refused") else f"  {record.get('signature', '')}"
    print(f"{record['seed']:>6}  {record['outcome']:<9} {took}  moves={record.get('moves', '-')}{extra}",
          flush=True)


def reproduction(seed: int, args: argparse.Namespace) -> str:
    flags = [f"--only {seed}"]
    if args.fsdp_every != FSDP_EVERY:
        flags.append(f"--fsdp-every {args.fsdp_every}")
    if args.library:
        flags.append(f"--library {args.library}")
    if args.mixed_autodetect:
        flags.append("--mixed-autodetect")
    flags += [f"--set {s}" for s in args.set]
    return f"python tests/fuzz/run.py {' '.join(flags)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="the first seed (seeds SEED .. SEED+DRAWS-1)")
    parser.add_argument("--only", type=int, action="append",
                        help="run this seed only (repeatable); keeps its log")
    parser.add_argument("--fsdp-every", type=int, default=FSDP_EVERY,
                        help="every N-th seed is an FSDP2 draw (0: none)")
    parser.add_argument("--jobs-per-launch", type=int, default=40, help="draws per job of ranks")
    parser.add_argument("--draw-timeout", type=float, default=240.0,
                        help="seconds before a draw counts as hung")
    parser.add_argument("--library", default=None, help="run this copy of vpipe (a directory holding vpipe/)")
    parser.add_argument("--mixed-autodetect", action="store_true", help="attach mixed draws without layers=")
    parser.add_argument("--set", action="append", default=[], metavar="AXIS=VALUE",
                        help="override an axis of every draw (to bisect a failure)")
    parser.add_argument("--work", default=None,
                        help="directory for job output and logs (default: a temporary one)")
    parser.add_argument("--keep-logs", action="store_true", help="keep every draw's vpipe log")
    parser.add_argument("--json", default=None, help="write every record and the summary here")
    args = parser.parse_args(argv)
    seeds = args.only or list(range(args.seed, args.seed + args.draws))
    refused = []
    for seed in seeds:  # a forced value that does not combine with what the seed drew: one line, not run
        try:
            override(draw(seed, args.fsdp_every), args.set)
        except Unsupported as e:
            refused.append(seed)
            print(f"not run: {e}", flush=True)
        except ValueError as e:  # an unknown axis or value
            parser.error(str(e))
    seeds = [s for s in seeds if s not in refused]
    if not seeds:
        parser.error(f"--set {' '.join(args.set)} combines with none of the seeds")
    work = Path(args.work or tempfile.mkdtemp(prefix="vpipe-fuzz-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{len(seeds)} draws, work directory {work}", flush=True)
    started = time.perf_counter()
    records = run_fuzz(seeds, work=work, fsdp_every=args.fsdp_every, per_launch=args.jobs_per_launch,
                       draw_timeout=args.draw_timeout, library=args.library,
                       mixed_autodetect=args.mixed_autodetect,
                       keep_logs=args.keep_logs or bool(args.only), settings=args.set, show=_show)
    wall = time.perf_counter() - started
    def draw_of(seed: int) -> Any:
        return override(draw(seed, args.fsdp_every), args.set)

    table = summary(records, draw_of)
    print_summary(table, wall)
    bad = failures(records, draw_of)
    for sig in bad:
        print(f"\n{sig['signature']}  ({len(sig['seeds'])} draws: {', '.join(map(str, sig['seeds'][:12]))})")
        if sig["common"]:
            print(f"  all of them: {', '.join(f'{k}={v}' for k, v in sig['common'].items())}")
        print(f"  reproduce: {reproduction(sig['seeds'][0], args)}")
        print(f"  logs: {work / 'logs'}/<seed>.log")
    if args.json:
        Path(args.json).write_text(json.dumps({"wall_s": wall, "summary": table, "failures": bad,
                                               "records": records}, indent=1, default=str))
    return 1 if any(r["outcome"] in FAILED for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
