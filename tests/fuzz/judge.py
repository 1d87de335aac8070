"""A draw's verdict, on rank 0: identical, close (to rounding, where allowed), refused, DIVERGED or ERROR.

``refused`` means vpipe logged a ``migration_refused`` line and the copies still agree (a refused
move leaves the old placement). A signature groups failures with one cause: an ERROR's phase and
exception, a DIVERGED draw's kinds of differing state.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from fuzz.compare import compare_losses, compare_maps, family, first_state_step, merge
from fuzz.draws import Draw

# refusals a draw expects: pinned blocks (hooks, sharing), a block kind a stage cannot
# build (mixed), a param group a stage does not have (per-stage groups), a layer
# factory under tensor parallelism (moves off at attach)
SECONDARY = ("timed out", "connection closed", "gloo")  # what a rank's peers report when it fails
EXPECTED_REFUSAL = re.compile(r"hook|shares|kind|group|build|torch\.distributed\.optim|layer_factory",
                              re.IGNORECASE)


def _log(log_file: Path) -> list[dict[str, Any]]:
    from vpipe.log import read_log

    return read_log(log_file) if log_file.exists() else []


def _squash(text: str) -> str:
    """A message with its numbers and parentheses blanked, so one cause gives one signature."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = re.sub(r"\([^)]*\)", "(..)", first)  # parentheses hold the specifics
    return re.sub(r"\d+(\.\d+)?", "#", line)[:140]


def _base(d: Draw, seconds: float) -> dict[str, Any]:
    return {"seed": d.seed, "describe": d.describe(), "draw": d.to_json(), "ranks": d.ranks,
            "seconds": round(seconds, 3)}


def judge(d: Draw, gathered: list[dict[str, Any]] | None, errors: list[dict[str, Any]], log_file: Path,
          seconds: float) -> dict[str, Any]:
    record = _base(d, seconds)
    records = _log(log_file)
    refusals = sorted({r["msg"] for r in records if r.get("event") == "migration_refused"
                       # moves off for a whole stage at attach (an optimizer
                       # wrapper such as ZeRO): a refusal too
                       or r.get("event") == "moves_off" and "layers will not move" in str(r.get("msg"))})
    record["refusals"] = refusals
    record["migrations"] = sum(1 for r in records if r.get("event") == "migration_done")
    # every forced plan should take effect (moved, refused or not): one that does not was stale or skipped
    record["plans"] = len(d.plans)
    applied = len({r.get("epoch") for r in records if r.get("event") == "plan_applied"})
    # under moves=planner no plan is forced: the planner's own plans are counted apart
    record["plans_applied"], record["planner_plans"] = (0, applied) if d.moves == "planner" else (applied, 0)
    record["plans_skipped"] = sorted({r["msg"] for r in records if r.get("event") == "plan_skipped"
                                      or "stale plan" in str(r.get("msg", ""))})[:4]
    if gathered is None:
        # the cause, not a peer's timeout (or closed connection) waiting for the rank that failed
        first = min(errors, key=lambda e: (any(w in e["message"].lower() for w in SECONDARY), e["rank"]))
        record.update(outcome="ERROR", error_phase=first["phase"], error=first["traceback"],
                      error_ranks=[e["rank"] for e in errors],
                      signature=f"ERROR[{first['phase'].split('@')[0]}] {first['type']}: "
                                f"{_squash(first['message'])}")
        return record
    placements = gathered[0]["placements"]
    record["moves"] = sum(1 for a, b in zip(placements, placements[1:]) if a != b)
    record["final_placement"] = placements[-1]
    record["rss_mb"] = round(max(g["rss_mb"] for g in gathered), 1)
    states, twice = {}, {}
    for name in ("plain", "vpipe"):
        states[name], twice[name] = merge([g["states"][name] for g in gathered])
    losses = {name: {int(k): v for g in gathered for k, v in g["losses"][name].items() if v}
              for name in ("plain", "vpipe")}
    prints = {}
    for name in ("plain", "vpipe"):
        steps = [merge([g["prints"][name][s] for g in gathered])[0] for s in range(d.steps)]
        prints[name] = steps
    state_cmp = compare_maps(states["plain"], states["vpipe"])
    loss_cmp = compare_losses(losses["plain"], losses["vpipe"])
    mismatch = {g["rank"]: g["mismatch"] for g in gathered if g["mismatch"]}
    differing = state_cmp["differing"]
    state_step, state_keys = first_state_step(prints["plain"], prints["vpipe"], d.rounding)
    record.update(first_diff_step=loss_cmp["first_step"], first_state_step=state_step,
                  first_state_keys=state_keys[:12],
                  max_abs_diff=max(state_cmp["max_abs_diff"], loss_cmp["max_abs_diff"]),
                  n_differing=len(differing), differing=differing[:12], largest=state_cmp["largest"],
                  placement_mismatch=mismatch, held_twice=twice["vpipe"][:12])
    record["max_abs_diff"] = None if math.isinf(record["max_abs_diff"]) else record["max_abs_diff"]
    bitwise = not differing and loss_cmp["first_step"] is None
    close = d.rounding and state_cmp["close"] and loss_cmp["close"]
    # ZeRO is refused (moves off, one line that names it): a ZeRO draw without that line has not been refused
    unrefused = d.dp == "zero" and not any("torch.distributed.optim" in m for m in refusals)
    if (bitwise or close) and not mismatch and not twice["vpipe"] and not unrefused:
        outcome = "refused" if refusals else ("identical" if bitwise else "close")
        record.update(outcome=outcome, signature=outcome)
        unexpected = [m for m in refusals if not EXPECTED_REFUSAL.search(m)]
        if unexpected:
            record["unexpected_refusals"] = unexpected
        return record
    kinds = sorted({family(k.split("/", 1)[-1]) for k in differing})
    if not differing:
        kinds = ["losses_only"]
    if mismatch:
        kinds.append("placement_mismatch")
    if twice["vpipe"]:
        kinds.append("block_on_two_stages")
    if unrefused:
        kinds.append("zero_not_refused")
    record.update(outcome="DIVERGED", signature="DIVERGED " + "+".join(kinds))
    return record
