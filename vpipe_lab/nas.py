"""Neural architecture search on a live pipeline: regularized evolution over transformer variants.

The search (Real et al.'s *regularized evolution*, the algorithm behind AmoebaNet and the
Evolved Transformer) keeps a population of architectures: each cycle samples a few, takes
the fittest as parent, mutates it (one block changes type, a block is added or removed)
and trains the child briefly; the oldest member dies. Every candidate is trained in the
*running* pipeline: vpipe morphs the model into it with ``add_layers`` / ``remove_layers``
(blocks both architectures share keep their weights), so the search never restarts
training — and vpipe's planner keeps the pipeline balanced while layers come and go.

Every rank runs the same search with the same seeded RNG; the only value one rank knows
alone, a candidate's loss on the last stage, is broadcast, so all ranks take identical
decisions at identical step boundaries.
"""

from __future__ import annotations

import json
import os
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from vpipe.files import make_dirs, write_atomic
from vpipe.log import decision
from vpipe_lab.runtime.models import BLOCK_TYPES, block_spec
from vpipe_lab.runtime.outputs import claim_outputs
from vpipe_lab.runtime.trainer import attach_vpipe, build_stage_run
from vpipe_lab.runtime.watchdog import stderr_line

__all__ = ["Architecture", "EvolutionConfig", "Candidate", "regularized_evolution", "morph"]


@dataclass(frozen=True)
class Architecture:
    """The searched part of a transformer: block types, in order, between embedding and head."""

    blocks: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("an architecture needs at least one block")
        bad = [b for b in self.blocks if b not in BLOCK_TYPES]
        if bad:
            raise ValueError(f"unknown block types {bad}; known: {', '.join(BLOCK_TYPES)}")

    def mutate(self, rng: random.Random, min_blocks: int, max_blocks: int) -> Architecture:
        """One random edit: change a block's type, insert a block, or delete one (within the size limits)."""
        moves = ["change"]
        if len(self.blocks) < max_blocks:
            moves.append("insert")
        if len(self.blocks) > min_blocks:
            moves.append("delete")
        move = rng.choice(moves)
        blocks = list(self.blocks)
        i = rng.randrange(len(blocks))
        if move == "change":
            blocks[i] = rng.choice([t for t in BLOCK_TYPES if t != blocks[i]])
        elif move == "insert":
            blocks.insert(i, rng.choice(BLOCK_TYPES))
        else:
            del blocks[i]
        return Architecture(tuple(blocks))

    def __str__(self) -> str:
        return "-".join(self.blocks)


@dataclass(frozen=True)
class EvolutionConfig:
    population: int = 4
    sample: int = 2
    cycles: int = 4
    steps_per_candidate: int = 4
    min_blocks: int = 2
    max_blocks: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("population", "sample", "steps_per_candidate", "min_blocks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.cycles, int) or self.cycles < 0:
            raise ValueError(f"cycles must be >= 0, got {self.cycles!r}")
        if self.sample > self.population:
            raise ValueError(f"sample ({self.sample}) cannot exceed population ({self.population})")
        if self.max_blocks < self.min_blocks:
            raise ValueError(f"max_blocks ({self.max_blocks}) < min_blocks ({self.min_blocks})")


@dataclass
class Candidate:
    arch: Architecture
    loss: float
    step: int  # training step at which it was evaluated


@dataclass
class SearchResult:
    best: Candidate
    history: list[Candidate] = field(default_factory=list)


def morph(vp: Any, current: list[tuple[int, str]], target: Architecture,
          spec_of: Callable[[str], dict[str, Any]]) -> list[tuple[int, str]]:
    """Edit the live model's blocks ``current`` ((id, type) in order) into ``target``; returns the new blocks.

    Blocks of the longest common prefix and suffix are kept with their weights; the ones
    between are removed and the target's middle blocks added in their place.
    """
    old = [kind for _, kind in current]
    new = list(target.blocks)
    head = 0
    while head < min(len(old), len(new)) and old[head] == new[head]:
        head += 1
    tail = 0
    while tail < min(len(old), len(new)) - head and old[-1 - tail] == new[-1 - tail]:
        tail += 1
    doomed = current[head:len(current) - tail]
    middle = new[head:len(new) - tail]
    kept_before, kept_after = current[:head], current[len(current) - tail:]
    added: list[tuple[int, str]] = []
    if middle:
        # model position: the embedding (1) plus the kept leading
        # blocks and the blocks still to remove before them
        position = 1 + head
        ids = vp.add_layers(position, [spec_of(kind) for kind in middle])
        added = list(zip(ids, middle))
    if doomed:
        vp.remove_layers([lid for lid, _ in doomed])
    return kept_before + added + kept_after


def agree(value: float, src: int) -> float:
    """``value`` as rank ``src`` has it, on every rank."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(t, src=src)
    return float(t.item())


def regularized_evolution(
    vp: Any,
    train_steps: Callable[[int], float],
    start: Sequence[tuple[int, str]],
    config: EvolutionConfig,
    spec_of: Callable[[str], dict[str, Any]],
    *,
    last_rank: int,
) -> SearchResult:
    """Search from the live model whose blocks are ``start``; ``train_steps(n)`` trains n steps and
    returns the mean loss on the last stage (any number elsewhere: it is broadcast from ``last_rank``)."""
    rng = random.Random(config.seed)
    blocks = list(start)
    population: deque[Candidate] = deque()
    history: list[Candidate] = []
    step = 0

    def evaluate(arch: Architecture) -> Candidate:
        nonlocal blocks, step
        blocks = morph(vp, blocks, arch, spec_of)
        loss = agree(train_steps(config.steps_per_candidate), last_rank)
        step += config.steps_per_candidate
        candidate = Candidate(arch, loss, step)
        history.append(candidate)
        decision("nas_candidate", f"{arch}: loss {loss:.4f}", architecture=list(arch.blocks), loss=loss,
                 blocks=len(arch.blocks), step=step)
        return candidate

    population.append(evaluate(Architecture(tuple(kind for _, kind in blocks))))
    while len(population) < config.population:
        parent = population[-1].arch
        population.append(evaluate(parent.mutate(rng, config.min_blocks, config.max_blocks)))
    for _ in range(config.cycles):
        sample = rng.sample(list(population), config.sample)
        parent = min(sample, key=lambda c: c.loss).arch
        population.append(evaluate(parent.mutate(rng, config.min_blocks, config.max_blocks)))
        population.popleft()  # regularized: the oldest dies, not the worst
    best = min(history, key=lambda c: c.loss)
    decision("nas_done", f"best {best.arch}: loss {best.loss:.4f} after {len(history)} candidates",
             architecture=list(best.arch.blocks), loss=best.loss, candidates=len(history))
    return SearchResult(best=best, history=history)


def block_spec_for(d_model: int, n_heads: int, dropout: float) -> Callable[[str], dict[str, Any]]:
    return lambda kind: block_spec(kind, d_model, n_heads, 4 * d_model, dropout)


def _write_result(out: Path, result: SearchResult, rank: int) -> None:
    """``out/nas.json`` (0600, a new file renamed into place: never through a link); a
    write that fails is said in one line, never a traceback."""
    body = {"best": {"architecture": list(result.best.arch.blocks), "loss": result.best.loss},
            "history": [{"architecture": list(c.arch.blocks), "loss": c.loss, "step": c.step}
                        for c in result.history]}
    try:
        make_dirs(out, "out_dir")
        write_atomic(out / "nas.json", json.dumps(body, indent=1).encode(), what="out_dir")
    except OSError as e:
        stderr_line(f"vpipe [rank {rank}]: cannot write the search's results to {out} "
                    f"({e.strerror or e}); the search finished without them")


def search_rank(cfg: Any, evo: EvolutionConfig, ctx: Any) -> SearchResult:
    """One rank of ``vpipe nas``: the reference transformer under vpipe, searched by regularized evolution."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if ctx.rank == 0:
        # --out-dir, --log-file and the trace directory, for as long as the run lives
        claim_outputs(cfg, hold=True)
    run = build_stage_run(cfg, ctx.rank, ctx.device)
    vp = attach_vpipe(cfg, run)
    state = {"step": 0}

    def train_steps(n: int) -> float:
        losses = []
        for _ in range(n):
            step_losses = run.run_step(state["step"])
            state["step"] += 1
            if step_losses:
                losses.append(float(torch.stack([loss.detach() for loss in step_losses]).mean()))
        return sum(losses) / len(losses) if losses else 0.0

    kinds = cfg.block_types or ["attn"] * cfg.blocks
    start = list(zip(range(1, cfg.blocks + 1), kinds))
    result = regularized_evolution(vp, train_steps, start, evo,
                                   block_spec_for(cfg.d_model, cfg.n_heads, cfg.dropout),
                                   last_rank=cfg.stage_rank(cfg.virtual_stages - 1))
    vp.detach()
    if cfg.out_dir and run.is_last:
        _write_result(Path(cfg.out_dir), result, ctx.rank)
    if run.is_last and cfg.progress:
        table = Table(title="regularized evolution (losses after a short training each)")
        for col in ("#", "architecture", "blocks", "loss"):
            table.add_column(col)
        for i, c in enumerate(result.history):
            mark = " (best)" if c is result.best else ""
            table.add_row(str(i), str(c.arch) + mark, str(len(c.arch.blocks)), f"{c.loss:.4f}")
        Console().print(table)
    return result
