"""The markdown pieces every report table shares: a table, a ratio with its spread, steps per round."""

from __future__ import annotations

__all__ = ["table", "ratio", "steps"]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def ratio(spread: dict[str, float] | None) -> str:
    return "-" if not spread else f"{spread['median']:.2f}x ({spread['min']:.2f}-{spread['max']:.2f})"



def steps(recoveries: list[int | None]) -> str:
    """One entry per round: ``"22 steps, never"``; ``"never"`` alone when no round got there."""
    if all(s is None for s in recoveries):
        return "never"
    return ", ".join("never" if s is None else f"{s} steps" for s in recoveries)
