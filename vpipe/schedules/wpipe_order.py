"""WPipe's order of a step: each group's 1F1B list on a rank, and the two merged as the paper's Figure 5 runs
them (docs/schedules.md, "WPipe"); apart from the schedule, which runs it."""

from __future__ import annotations

import functools
from collections import deque
from typing import NamedTuple

__all__ = ["Op", "Action", "one_f_one_b", "rank_orders", "steady_order"]

Op = tuple[int, str, int]  # an action of a rank's step: (group, "F" | "B", micro-batch of its period)


class Action(NamedTuple):
    """One compute action of a rank, as torch's action lists name it (what :mod:`vpipe.sharing` reads)."""

    stage_index: int
    computation_type: str  # "F" or "B"
    microbatch_index: int


def one_f_one_b(num_stages: int, k: int, m: int, forwards: bool = True,
                backwards: bool = True) -> list[tuple[str, int]]:
    """Stage ``k`` of ``num_stages``'s 1F1B order over ``m`` micro-batches: ``num_stages - k`` forwards, then
    a backward and a forward in turn, then the last backwards. Without forwards (or backwards) the others
    alone."""
    if not forwards or not backwards:
        return [("F" if forwards else "B", j) for j in range(m)]
    warm = min(num_stages - k, m)
    order, f = [("F", j) for j in range(warm)], warm
    for b in range(m):
        order.append(("B", b))
        if f < m:
            order.append(("F", f))
            f += 1
    return order


def _needs(group: int, kind: str, r: int, j: int, ranks: int) -> tuple[int, str, int, int] | None:
    """What action (group, kind, rank, micro-batch) of this step must end before this one can start."""
    if kind == "F":
        if r:
            return group, "F", r - 1, j
        return (0, "F", ranks - 1, j) if group else None  # G1's first stage takes G0's last stage's output
    if r < ranks - 1:
        return group, "B", r + 1, j
    return (1, "F", r, j) if group else None  # G0's last stage got its gradient in the step before


@functools.lru_cache(maxsize=16)
def rank_orders(ranks: int, m: int, forwards: bool = True, backwards: bool = True) -> dict[int, list[Op]]:
    """Every rank's actions in one step, ``(group, "F" | "B", micro-batch)``: G0's 1F1B list (this period's
    forwards, the period before's backwards) and G1's (this period) merged as Figure 5 runs them, a rank
    taking the other group's next action when both can run, else the one that can. Worked out by playing the
    step on every rank at once (a forward one unit long, a backward two), so each rank's order starts an
    action only after what it receives was sent: the order is the same on every rank and cannot deadlock."""
    queues = {r: [deque((0, k, j) for k, j in one_f_one_b(ranks, r, m, forwards, backwards)),
                  deque((1, k, j) for k, j in (one_f_one_b(ranks, r, m) if forwards else []))]
              for r in range(ranks)}
    ends: dict[tuple[int, str, int, int], int] = {}
    free, last, now = [0] * ranks, [1] * ranks, 0
    orders: dict[int, list[Op]] = {r: [] for r in range(ranks)}
    while any(q for r in range(ranks) for q in queues[r]):
        for r in range(ranks):
            if free[r] > now:
                continue
            ready = []
            for q in queues[r]:
                if q:
                    need = _needs(q[0][0], q[0][1], r, q[0][2], ranks)
                    if need is None or ends.get(need, now + 1) <= now:
                        ready.append(q)
            if ready:
                op = (ready[0] if len(ready) == 1 or ready[0][0][0] != last[r] else ready[1]).popleft()
                last[r], free[r] = op[0], now + (1 if op[1] == "F" else 2)
                ends[(op[0], op[1], r, op[2])] = free[r]
                orders[r].append(op)
        now += 1
        if now > 8 * m * ranks + 16:  # every action of the step takes at most 2 units on one of 2m per rank
            raise RuntimeError(f"WPipe's order for {ranks} ranks and {m} micro-batches does not finish")
    return orders


def steady_order(ranks: int, m: int) -> dict[int, list[Action]]:
    """Each rank's actions in a step after the first, led by the forwards of the period before on G0 (held
    since the step before): micro-batch ``j`` of that period is ``j``, of the step's period ``m + j``. vpipe
    reads the micro-batches each stage holds at once off it, as off torch's multi-stage schedules' lists."""
    order = {}
    for r, ops in rank_orders(ranks, m).items():
        actions = [Action(r, "F", j) for j in range(m)]
        actions += [Action(r + ranks * g, kind, j if (g, kind) == (0, "B") else m + j) for g, kind, j in ops]
        order[r] = actions
    return order
