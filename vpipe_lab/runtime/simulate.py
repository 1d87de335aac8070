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

Uneven devices (a straggler, an older GPU in the mix): ``stage_speeds[k]`` multiplies
stage ``k``'s compute (forward, backward, optimizer step), the same meaning as the
planner's ``stage_speeds`` (1.0 = the reference device the costs were measured on, 1.5 =
a device that takes 1.5x as long). Boundary transfers run on links, not on the device, and
keep their times.
"""

from __future__ import annotations

import heapq
import math
import numbers
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["StageCost", "SimResult", "simulate", "action_order", "on_devices"]


@dataclass(frozen=True)
class StageCost:
    """Seconds per micro-batch on one stage (on the reference device
    when ``simulate`` gets ``stage_speeds``)."""

    fwd_s: float
    bwd_s: float
    send_s: float = 0.0  # boundary transfer to the next stage (activations forward, gradients back)
    # one optimizer step (per step for flush schedules, per micro-batch for PipeDream)
    optimizer_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fwd_s", "bwd_s", "send_s", "optimizer_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"stage cost {name} must be finite and >= 0, got {value}")


@dataclass
class SimResult:
    step_s: float  # steady-state seconds per step (m micro-batches): median period over the second half
    total_s: float
    busy_s: list[float] = field(default_factory=list)  # per stage, compute seconds
    finish_s: list[float] = field(default_factory=list)  # per step, when its last action ended

    @property
    def bubble_fraction(self) -> float:
        if self.total_s <= 0 or not self.busy_s:
            return 0.0
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.total_s)


def action_order(schedule: str, stage: int, num_stages: int, micro_batches: int,
                 steps: int) -> list[tuple[str, int]]:
    """This stage's actions ``("F"|"B"|"O", global micro-batch)``
    over ``steps`` steps (``O`` = optimizer step)."""
    p, m = num_stages, micro_batches
    warm = p - stage
    out: list[tuple[str, int]] = []
    if schedule in ("pipedream", "pipedream2bw"):  # one stream; 2BW steps the optimizer once a period
        total = steps * m
        f = b = 0
        while b < total:
            if f < total and (f - b < warm):
                out.append(("F", f))
                f += 1
            else:
                out.append(("B", b))
                if schedule == "pipedream" or (b + 1) % m == 0:
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
            raise ValueError(
                f"unknown schedule {schedule!r}; expected gpipe, 1f1b, pipedream or pipedream2bw"
            )
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
    background: float = 0.0,
    stage_speeds: Sequence[float] | None = None,
) -> SimResult:
    """Simulate ``steps`` steps of ``costs`` (one entry per stage) under ``schedule``.

    ``stall_s[k]`` pauses every stage for that long before its first action of step ``k``
    (a migration at that step boundary); a pause occupies no core. ``cores`` (default: one
    per stage) are shared equally by the stages that are computing and ``background``
    always-busy threads of other processes (a shared machine's load, in cores).
    ``stage_speeds`` (one positive factor per stage, default all 1.0) multiplies each
    stage's compute, not its transfers: a slower or faster device than the costs' own.
    """
    p, m = len(costs), micro_batches
    if p < 1 or m < 1 or steps < 1:
        raise ValueError("need at least one stage, micro-batch and step")
    if stage_speeds is not None:
        costs = on_devices(costs, stage_speeds)
    if schedule in ("1f1b", "pipedream", "pipedream2bw") and m < p:
        raise ValueError(f"{schedule} needs micro_batches >= stages ({m} < {p})")
    if not math.isfinite(background) or background < 0:
        raise ValueError(f"background load must be finite and >= 0, got {background}")
    if any(not math.isfinite(x) or x < 0 for x in stall_s):
        raise ValueError(f"stalls must be finite and >= 0, got {list(stall_s)}")
    cores = p if cores is None else max(1, cores)
    orders = [_with_stalls(action_order(schedule, s, p, m, steps), stall_s, m) for s in range(p)]
    nxt = [0] * p
    done: dict[tuple[str, int, int], float] = {}
    busy = [0.0] * p
    step_end = [0.0] * steps
    now = 0.0
    # Computing actions share the cores equally, so all advance at one rate: each ends when the service every
    # computing action has received (``served``, seconds of work) reaches its start value plus its duration.
    served = 0.0
    computing: dict[int, tuple[str, int, float]] = {}  # stage -> (kind, micro-batch, duration)
    ends: list[tuple[float, int]] = []  # heap of (served at its end, stage) of the computing actions
    wakes: list[tuple[float, int]] = []  # heap of (time its input arrives, stage) of stages waiting for it
    pausing: dict[int, float] = {}  # stage -> when its stall ends
    check = set(range(p))  # stages whose next action may be able to start now

    def duration(s: int, kind: str) -> float:
        c = costs[s]
        return c.fwd_s if kind == "F" else c.bwd_s if kind == "B" else c.optimizer_s

    def ready_at(s: int, kind: str, mb: int) -> float | None:
        if kind == "F":
            if s == 0:
                return now
            t = done.get(("F", s - 1, mb))
            return None if t is None else t + costs[s - 1].send_s
        if kind == "B":
            if s == p - 1:
                return done.get(("F", s, mb))
            t = done.get(("B", s + 1, mb))
            return None if t is None else t + costs[s].send_s
        return now

    eps = 1e-12
    while True:
        for s in sorted(check):
            if s in computing or s in pausing or nxt[s] >= len(orders[s]):
                continue
            kind, arg = orders[s][nxt[s]]
            if kind == "W":
                pausing[s] = now + stall_s[arg]
                nxt[s] += 1
                continue
            t = ready_at(s, kind, arg)
            if t is None:
                continue  # its input is not computed yet: the neighbour's finish brings it back to ``check``
            if t <= now + eps:
                computing[s] = (kind, arg, duration(s, kind))
                heapq.heappush(ends, (served + computing[s][2], s))
                nxt[s] += 1
            else:
                heapq.heappush(wakes, (t, s))
        check.clear()
        rate = min(1.0, cores / (len(computing) + background)) if computing else 0.0
        events = [t for t, _ in wakes[:1]] + ([min(pausing.values())] if pausing else [])
        if ends:
            events.append(now + max(0.0, ends[0][0] - served) / rate)
        if not events:
            break
        dt = max(0.0, min(events) - now)
        now += dt
        served += dt * rate
        while ends and ends[0][0] <= served + eps:
            _, s = heapq.heappop(ends)
            kind, mb, work = computing.pop(s)
            busy[s] += work
            done[(kind, s, mb)] = now
            k = min(mb // m, steps - 1)
            step_end[k] = max(step_end[k], now)
            check.update(n for n in (s - 1, s, s + 1) if 0 <= n < p)
        while wakes and wakes[0][0] <= now + eps:
            check.add(heapq.heappop(wakes)[1])
        for s in [s for s, end in pausing.items() if end <= now + eps]:
            del pausing[s]
            check.add(s)
    if any(nxt[s] < len(orders[s]) for s in range(p)):
        raise RuntimeError(
            "simulation deadlocked: an action waits for one that never runs"
        )  # pragma: no cover
    total = max(done.values()) if done else 0.0
    return SimResult(step_s=_steady_step_s(step_end, schedule, total), total_s=total, busy_s=busy,
                     finish_s=step_end)


def on_devices(costs: Sequence[StageCost], stage_speeds: Sequence[float]) -> list[StageCost]:
    """``costs`` with stage ``k``'s compute (forward, backward, optimizer) times ``stage_speeds[k]``.

    Transfers keep their times: they run on links, not on the device's cores. A factor
    of 1.0 leaves a cost exactly as it was (``x * 1.0 == x``), so all ones reproduce the
    plain simulation bit for bit.
    """
    speeds = list(stage_speeds)
    if len(speeds) != len(costs):
        raise ValueError(
            f"stage_speeds must give one factor per stage: {len(speeds)} for {len(costs)} stages"
        )
    bad = [(k, v) for k, v in enumerate(speeds)
           if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0)]
    if bad:
        k, v = bad[0]
        raise ValueError(f"stage_speeds must be positive finite numbers, got {v!r} for stage {k}")
    return [StageCost(fwd_s=c.fwd_s * v, bwd_s=c.bwd_s * v, send_s=c.send_s, optimizer_s=c.optimizer_s * v)
            for c, v in zip(costs, speeds)]


def _with_stalls(order: list[tuple[str, int]], stall_s: Sequence[float], m: int) -> list[tuple[str, int]]:
    """Insert a pause ``("W", k)`` before this stage's first forward of step ``k`` when ``stall_s[k] > 0``."""
    out: list[tuple[str, int]] = []
    for kind, mb in order:
        k = mb // m
        if kind == "F" and mb % m == 0 and k < len(stall_s) and stall_s[k] > 0:
            out.append(("W", k))
        out.append((kind, mb))
    return out


def _steady_step_s(step_end: list[float], schedule: str, total: float) -> float:
    """The median step-to-step period over the second half of the steps.

    The first steps fill the pipeline, and PipeDream's last step only drains it (nothing
    new enters), so neither is the steady state.
    """
    gaps = [b - a for a, b in zip(step_end, step_end[1:])]
    if schedule in ("pipedream", "pipedream2bw") and len(gaps) > 1:
        gaps = gaps[:-1]
    if not gaps:
        return total / max(1, len(step_end))
    return statistics.median(gaps[len(gaps) // 2:])
