"""The fuzzer's summary: outcomes per axis value, and the failures
grouped by signature with what they share."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from fuzz.draws import AXES, DERIVED, Draw

OUTCOMES = ("identical", "close", "refused", "DIVERGED", "ERROR")


def summary(records: list[dict[str, Any]], draw_of: Callable[[int], Draw]) -> dict[str, Any]:
    """Outcome counts overall and per axis value, and the time per draw."""
    per_axis: dict[str, dict[str, dict[str, int]]] = {axis: {} for axis in AXES}
    for r in records:
        d = draw_of(r["seed"])
        for axis in AXES:
            cell = per_axis[axis].setdefault(str(getattr(d, axis)), dict.fromkeys(OUTCOMES, 0))
            cell[r["outcome"]] += 1
    seconds = [r["seconds"] for r in records if isinstance(r.get("seconds"), (int, float))]
    by_ranks: dict[str, list[float]] = {}
    for r in records:
        if isinstance(r.get("seconds"), (int, float)):
            by_ranks.setdefault(str(r["ranks"]), []).append(r["seconds"])
    return {"draws": len(records), "outcomes": dict(Counter(r["outcome"] for r in records)),
            "per_axis": per_axis, "seconds_per_draw": sum(seconds) / len(seconds) if seconds else None,
            "seconds_per_draw_by_ranks": {k: sum(v) / len(v) for k, v in by_ranks.items()},
            "moves": sum(r.get("moves") or 0 for r in records),
            "plans": sum(r.get("plans") or 0 for r in records if "plans_applied" in r),
            "plans_applied": sum(r.get("plans_applied") or 0 for r in records),
            "planner_plans": sum(r.get("planner_plans") or 0 for r in records)}


def print_summary(table: dict[str, Any], wall_s: float) -> None:
    print(f"\n{'axis=value':<26}" + "".join(f"{o:>10}" for o in OUTCOMES))
    for axis, values in table["per_axis"].items():
        for value, cell in sorted(values.items()):
            label = f"{axis}={value if value else '-'}"
            print(f"{label:<26}" + "".join(f"{cell[o]:>10}" for o in OUTCOMES))
    total = table["outcomes"]
    print(f"{'all':<26}" + "".join(f"{total.get(o, 0):>10}" for o in OUTCOMES))
    per = table["seconds_per_draw"]
    by = ", ".join(f"{k} ranks {v:.2f} s" for k, v in sorted(table["seconds_per_draw_by_ranks"].items()))
    print(f"\n{table['draws']} draws, {table['plans_applied']} of {table['plans']} forced plans applied "
          f"(moved or refused), {table.get('planner_plans', 0)} plans of vpipe's planner applied "
          f"(moves=planner), {table['moves']} placement changes, wall {wall_s:.1f} s"
          + (f", {per:.2f} s per draw inside its job ({by})" if per is not None else ""))


def failures(records: list[dict[str, Any]], draw_of: Callable[[int], Draw]) -> list[dict[str, Any]]:
    """DIVERGED and ERROR draws grouped by signature, each with the axis values all of its draws share and
    that not every draw of the run shares (the likely cause), most frequent first."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r["outcome"] in ("DIVERGED", "ERROR"):
            groups.setdefault(r["signature"], []).append(r)
    everyone = _shared([draw_of(r["seed"]) for r in records])
    out = []
    for sig, members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        shared = _shared([draw_of(r["seed"]) for r in members])
        common = {k: v for k, v in shared.items() if everyone.get(k) != v}
        out.append({"signature": sig, "seeds": [r["seed"] for r in members], "common": common,
                    "example": {k: members[0].get(k) for k in ("describe", "first_diff_step",
                                                               "first_state_step",
                                                               "differing", "max_abs_diff", "error_phase")}})
    return out


def _shared(draws: list[Any]) -> dict[str, Any]:
    """The axis values every draw has."""
    if not draws:
        return {}
    return {axis: getattr(draws[0], axis) for axis in (*AXES, *DERIVED)
            if all(getattr(d, axis) == getattr(draws[0], axis) for d in draws)}
