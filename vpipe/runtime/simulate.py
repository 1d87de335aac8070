"""A discrete-event simulation of pipeline schedules, for sizes and hardware we cannot run.

Each stage executes its schedule's fixed action order (GPipe: all forwards then all
backwards; 1F1B: ``p-k`` warm-up forwards then alternating; PipeDream: 1F1B streamed over
steps with an optimizer step per micro-batch). An action starts when its stage is free
and its input arrived: a forward needs the previous stage's forward of the same
micro-batch plus the boundary transfer, a backward needs the next stage's backward. The
per-stage costs come from measured layer profiles and the plan's policies (recompute adds
the forward to the backward, swap adds what the copy link cannot hide).

When there are fewer cores than stages (4 ranks on a 2-core machine), busy stages share
the cores equally (processor sharing), which is what the OS scheduler does to
single-threaded ranks; the simulation then advances in fluid time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["StageCost", "SimResult", "simulate", "action_order"]


@dataclass(frozen=True)
class StageCost:
    """Seconds per micro-batch on one stage."""

    fwd_s: float
    bwd_s: float
    send_s: float = 0.0  # boundary transfer to the next stage (activations forward, gradients back)
    optimizer_s: float = 0.0  # one optimizer step (per step for flush schedules, per micro-batch for PipeDream)

    def __post_init__(self) -> None:
        for name in ("fwd_s", "bwd_s", "send_s", "optimizer_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"stage cost {name} must be finite and >= 0, got {value}")


@dataclass
class SimResult:
    step_s: float  # steady-state seconds per step (per m micro-batches)
    total_s: float
    busy_s: list[float] = field(default_factory=list)  # per stage, compute seconds
    finish_s: list[float] = field(default_factory=list)  # per step, when its last action ended

    @property
    def bubble_fraction(self) -> float:
        if self.total_s <= 0 or not self.busy_s:
            return 0.0
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.total_s)


def action_order(schedule: str, stage: int, num_stages: int, micro_batches: int, steps: int) -> list[tuple[str, int]]:
    """This stage's actions ``("F"|"B"|"O", global micro-batch)`` over ``steps`` steps (``O`` = optimizer step)."""
    p, m = num_stages, micro_batches
    warm = p - stage
    out: list[tuple[str, int]] = []
    if schedule == "pipedream":
        total = steps * m
        f = b = 0
        while b < total:
            if f < total and (f - b < warm):
                out.append(("F", f))
                f += 1
            else:
                out.append(("B", b))
                out.append(("O", b))
                b += 1
        return out
    for s in range(steps):
        base = s * m
        if schedule == "gpipe":
            out += [("F", base + i) for i in range(m)] + [("B", base + i) for i in range(m)]
        elif schedule == "1f1b":
            w = min(warm, m)
            seq = [("F", base + i) for i in range(w)]
            f, b = w, 0
            while b < m:
                seq.append(("B", base + b))
                b += 1
                if f < m:
                    seq.append(("F", base + f))
                    f += 1
            out += seq
        else:
            raise ValueError(f"unknown schedule {schedule!r}; expected gpipe, 1f1b or pipedream")
        out.append(("O", base + m - 1))
    return out


def simulate(
    costs: Sequence[StageCost],
    *,
    schedule: str,
    micro_batches: int,
    steps: int = 4,
    cores: int | None = None,
    stall_s: Sequence[float] = (),
) -> SimResult:
    """Simulate ``steps`` steps; ``stall_s[k]`` adds a pause on every stage before step ``k`` (migration)."""
    p, m = len(costs), micro_batches
    if p < 1 or m < 1 or steps < 1:
        raise ValueError("need at least one stage, micro-batch and step")
    if schedule in ("1f1b", "pipedream") and m < p:
        raise ValueError(f"{schedule} needs micro_batches >= stages ({m} < {p})")
    cores = p if cores is None else max(1, cores)
    orders = [action_order(schedule, s, p, m, steps) for s in range(p)]
    nxt = [0] * p
    done: dict[tuple[str, int, int], float] = {}
    busy = [0.0] * p
    now = 0.0
    running: dict[int, tuple[tuple[str, int], float]] = {}  # stage -> (action, remaining seconds of work)
    step_end = [0.0] * steps

    def duration(s: int, kind: str) -> float:
        c = costs[s]
        return c.fwd_s if kind == "F" else c.bwd_s if kind == "B" else c.optimizer_s

    def ready_at(s: int, kind: str, mb: int) -> float | None:
        step = mb // m
        gate = sum(stall_s[: step + 1]) if stall_s else 0.0
        if kind == "F":
            if s == 0:
                return gate
            t = done.get(("F", s - 1, mb))
            return None if t is None else max(gate, t + costs[s - 1].send_s)
        if kind == "B":
            if s == p - 1:
                return done.get(("F", s, mb))
            t = done.get(("B", s + 1, mb))
            return None if t is None else t + costs[s].send_s
        return now

    ready_time: dict[int, float] = {}
    while True:
        for s in range(p):
            if s in running or nxt[s] >= len(orders[s]):
                continue
            kind, mb = orders[s][nxt[s]]
            t = ready_at(s, kind, mb)
            if t is None:
                continue
            if t <= now + 1e-15:
                running[s] = ((kind, mb), duration(s, kind))
                nxt[s] += 1
            else:
                ready_time[s] = t
        if not running:
            pending = [ready_time[s] for s in ready_time if s not in running and nxt[s] < len(orders[s])]
            ready_time.clear()
            if not pending:
                break
            now = min(pending)
            continue
        rate = min(1.0, cores / len(running))
        upcoming = [t for s, t in ready_time.items() if s not in running and t > now]
        ready_time.clear()
        dt = min(rem / rate for _, rem in running.values())
        if upcoming:
            dt = min(dt, min(upcoming) - now)
        now += dt
        for s in list(running):
            (kind, mb), rem = running[s]
            rem -= dt * rate
            busy[s] += dt * rate
            if rem <= 1e-12:
                done[(kind, s, mb)] = now
                step_end[min(mb // m, steps - 1)] = max(step_end[min(mb // m, steps - 1)], now)
                del running[s]
            else:
                running[s] = ((kind, mb), rem)
    total = max(done.values()) if done else 0.0
    if steps >= 3:
        step_s = (step_end[-1] - step_end[0]) / (steps - 1)
    else:
        step_s = total / steps
    return SimResult(step_s=step_s, total_s=total, busy_s=busy, finish_s=step_end)
