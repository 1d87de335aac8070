"""The ``vpipe`` command: the library's commands plus the laboratory's
``demo | train | nas | logs | plot | bench``.

``vpipe train`` is torchrun-compatible: launched by torchrun (``RANK`` set) it runs one
rank; run directly it spawns ``--stages`` ranks on this host and waits for them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence

from vpipe import cli as library_cli
from vpipe import log
from vpipe.control import daemon
from vpipe.planner import DEFAULT_PLANNER
from vpipe.sizes import parse_bytes
from vpipe_lab import bench, demo, logview, plot
from vpipe_lab.runtime.config import LR_SCHEDULES, MODELS, OPTIMIZERS, SCHEDULES, RunConfig
from vpipe_lab.runtime.layout import MULTI_STAGE, STREAMS
from vpipe_lab.runtime.outputs import check_vpipe_outputs, claim_outputs, run_log_file


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _partition(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"partition must be comma-separated layer counts like 5,5, got {text!r}") from None


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text, what="memory budget")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _directory_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("needs a directory (an empty name would train from scratch)")
    return text


def _json_list(text: str) -> list:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    except RecursionError:
        raise argparse.ArgumentTypeError("its JSON nests too deeply to be a list of edits") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError("expected a JSON list")
    return value


def _moves(text: str) -> list[dict]:
    moves = []
    for part in filter(None, text.split(";")):
        step, sep, counts = part.partition(":")
        try:
            moves.append({"step": int(step), "partition": [int(c) for c in counts.split(",")]})
        except ValueError:
            raise argparse.ArgumentTypeError(f"moves look like '3:6,4;8:4,6', got {text!r}") from None
        if not sep:
            raise argparse.ArgumentTypeError(f"moves look like '3:6,4;8:4,6', got {text!r}")
    return moves


def add_run_arguments(p: argparse.ArgumentParser, *, steps: int, stages: int) -> None:
    p.add_argument("--model", choices=MODELS, default="transformer")
    p.add_argument("--blocks", type=_positive_int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--d-model", type=_positive_int, default=64)
    p.add_argument("--n-heads", type=_positive_int, default=4)
    p.add_argument("--seq-len", type=_positive_int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--stages", type=_positive_int, default=None,
                   help="pipeline ranks, one stage each under gpipe, 1f1b, pipedream, pipedream2bw (default: "
                        f"WORLD_SIZE under torchrun, else {stages})")
    p.set_defaults(default_stages=stages)
    p.add_argument("--schedule", choices=SCHEDULES, default="gpipe",
                   help=f"{', '.join(MULTI_STAGE)} run several virtual stages per rank")
    p.add_argument("--stages-per-rank", type=_positive_int, default=None, metavar="N",
                   help="virtual stages per rank under a multi-stage schedule (default 2; zbv, dualpipev and "
                        "wpipe: exactly 2); --partition and --moves then count layers per virtual stage")
    p.add_argument("--micro-batches", type=_positive_int, default=4)
    p.add_argument("--micro-batch-size", type=_positive_int, default=4)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="warmup-cosine: linear warm-up over --warmup-steps, then cosine to 0 at --steps")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partition", type=_partition, default=None,
                   help="layers per (virtual) stage, in model order, e.g. 6,4")
    p.add_argument("--vertical-sync", action="store_true",
                   help="PipeDream: every stage uses stage 0's weight version")
    p.add_argument("--log-file", default=None,
                   help="append JSON-lines logs (decisions included) here (default: $VPIPE_LOG_FILE)")
    p.add_argument("--out-dir", default=None, help="save each rank's final parameters and losses here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--monitor-every", type=int, default=0, metavar="K",
                   help="measure every K-th step and send the stats to the planner daemon (default 0: off)")
    p.add_argument("--planner", default="auto", metavar="MODULE:FUNCTION",
                   help="planner the last stage's daemon runs (auto: the SRP planner with "
                        "--vpipe, else one that "
                        "never plans); 'none' starts no daemon and waits for `vpipe planner --connect ...`")
    p.add_argument("--vpipe", action="store_true",
                   help="attach vpipe: tensor manager, monitor, planner, live migration")
    p.add_argument("--memory-budget", type=_bytes, default=None, metavar="BYTES",
                   help="vpipe: per-stage memory budget (parameters, gradients, optimizer "
                        "state, activations), e.g. 64M")
    p.add_argument("--policy", choices=("D", "S", "R"), default=None,
                   help="vpipe: initial policy of every layer: keep (D), swap (S) or "
                        "recompute (R) activations")
    p.add_argument("--no-planning", action="store_true", help="vpipe: monitor only, never apply plans")
    p.add_argument("--nas", type=_json_list, default=None, metavar="JSON",
                   help="vpipe: layer edits, e.g. '[{\"step\": 5, \"add\": {\"position\": 1, "
                        "\"types\": [\"attn\"]}}, {\"step\": 9, \"remove\": [3]}]'")
    p.add_argument("--moves", type=_moves, default=None, metavar="STEP:COUNTS[;...]",
                   help="vpipe: forced repartitions, e.g. '3:6,4;8:4,6' moves layers before steps 3 and 8")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write checkpoints (one step-N directory each, sealed by a manifest) "
                        "here, at the end and every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="checkpoint every N steps")
    p.add_argument("--resume", default=None, metavar="DIR", type=_directory_name,
                   help="continue from this checkpoint (a step-N directory, or the newest complete one under "
                        "DIR); --steps counts from the start of the original run; any number of stages")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        model=args.model, blocks=args.blocks, d_model=args.d_model, n_heads=args.n_heads,
        seq_len=args.seq_len, dropout=args.dropout, stages=_stages(args), schedule=args.schedule,
        stages_per_rank=args.stages_per_rank,
        micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size, steps=args.steps,
        lr=args.lr, optimizer=args.optimizer, weight_decay=args.weight_decay, lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps, seed=args.seed, partition=args.partition,
        vertical_sync=args.vertical_sync, log_file=run_log_file(args.log_file), out_dir=args.out_dir,
        progress=not args.no_progress, monitor_every=args.monitor_every,
        planner=_planner(args), vpipe=args.vpipe, memory_budget=args.memory_budget, policy=args.policy or "D",
        planning=not args.no_planning, moves=args.moves, nas=args.nas,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
    )


def _stages(args: argparse.Namespace) -> int:
    """--stages, else one stage per rank under torchrun, else the command's default."""
    if args.stages is not None:
        return args.stages
    from vpipe_lab.runtime.launch import rank_env

    env = rank_env()
    return env.world_size if env is not None else args.default_stages


def _planner(args: argparse.Namespace) -> str | None:
    if args.planner == "none":
        return None
    if args.planner == "auto":
        return DEFAULT_PLANNER if args.vpipe else daemon.NO_CHANGE_PLANNER
    if not (args.vpipe or args.monitor_every):
        raise ValueError(f"--planner {args.planner}: no statistics reach a planner without --vpipe or "
                         "--monitor-every K")
    module = args.planner.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(f"--planner {args.planner}: no module {module!r} to import (give "
                         "MODULE:FUNCTION, the module importable from here)")
    return args.planner


def cmd_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from vpipe_lab.runtime.launch import rank_env, spawn

    if not args.vpipe and (args.memory_budget is not None or args.policy is not None):
        raise ValueError("--memory-budget and --policy are vpipe's (its tensor manager): add --vpipe")
    cfg = config_from_args(args)  # validate before starting any process (its paths included)
    check_vpipe_outputs(cfg.vpipe)  # the trace and metrics directories the environment names
    if rank_env() is None:
        from vpipe_lab.runtime.checkpoints import check_checkpoint_dir

        # the launcher looks before any rank starts; a rank never does (rank 0 takes the lock for the run, and
        # a rank that took it to look while rank 0 took it made rank 0 report the directory in use)
        check_checkpoint_dir(cfg)
        claim_outputs(cfg, hold=False)  # --out-dir, --log-file and the trace directory: no other run's
        if cfg.resume:
            from vpipe_lab.runtime.checkpoints import load_resume

            # a bad checkpoint is named here, before any rank starts
            if load_resume(cfg, verify="all") is None:
                print(f"vpipe: --resume {cfg.resume}: no checkpoint there yet; starting from step 0",
                      file=sys.stderr)
        return spawn([sys.executable, "-m", "vpipe_lab", *argv], cfg.stages)
    return _run_as_rank(cfg)


def _run_as_rank(cfg: RunConfig) -> int:
    from vpipe_lab.runtime.launch import init_distributed, run_rank
    from vpipe_lab.runtime.trainer import train_rank

    ctx = init_distributed()
    log.configure(cfg.log_file, rank=ctx.rank)
    run_rank(ctx, train_rank, cfg, ctx)
    return 0


def cmd_nas(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from vpipe_lab.nas import EvolutionConfig
    from vpipe_lab.runtime.launch import rank_env, spawn

    cfg = config_from_args(args)
    if cfg.schedule in STREAMS:
        raise ValueError("vpipe nas adds and removes layers, which needs a flush schedule "
                         f"(any but {cfg.schedule})")
    if cfg.checkpoint_dir or cfg.resume:
        raise ValueError("vpipe nas writes no checkpoints and cannot resume from one: drop "
                         "--checkpoint-dir/--resume")
    if not cfg.vpipe:
        planner = cfg.planner if cfg.planner != daemon.NO_CHANGE_PLANNER else DEFAULT_PLANNER
        cfg = RunConfig(**{**cfg.to_dict(), "vpipe": True, "planner": planner})
    check_vpipe_outputs(cfg.vpipe)
    if rank_env() is None:
        claim_outputs(cfg, hold=False)  # --out-dir, --log-file and the trace directory: no other run's
    evo = EvolutionConfig(population=args.population, sample=args.sample, cycles=args.cycles,
                          steps_per_candidate=args.steps_per_candidate, seed=args.seed)
    if rank_env() is None:
        return spawn([sys.executable, "-m", "vpipe_lab", *argv], cfg.stages)
    from vpipe_lab.nas import search_rank
    from vpipe_lab.runtime.launch import init_distributed, run_rank

    ctx = init_distributed()
    log.configure(cfg.log_file, rank=ctx.rank)
    run_rank(ctx, search_rank, cfg, evo, ctx)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser, sub = library_cli.build_parser(__doc__.splitlines()[0])

    train = sub.add_parser("train", help="train a reference model on a pipeline of ranks")
    add_run_arguments(train, steps=20, stages=2)
    train.set_defaults(func=cmd_train)

    nas = sub.add_parser("nas",
                         help="regularized evolution over transformer variants, on a live vpipe pipeline")
    add_run_arguments(nas, steps=0, stages=2)
    nas.add_argument("--population", type=_positive_int, default=4)
    nas.add_argument("--sample", type=_positive_int, default=2)
    nas.add_argument("--cycles", type=int, default=4)
    nas.add_argument("--steps-per-candidate", type=_positive_int, default=4)
    nas.set_defaults(func=cmd_nas)

    bench.register(sub)
    logview.register(sub)
    plot.register(sub)
    demo.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return library_cli.run(build_parser(), sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
