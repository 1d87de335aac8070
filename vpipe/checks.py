"""The one way a configuration says what is wrong with it: ``ValueError`` with a message that names the
field, in a line a terminal can show (:func:`shorten`)."""

from __future__ import annotations

import re

__all__ = ["require", "shorten"]

LONGEST_WORD = 512  # longer than any path anyone types; a value past it is cut where a line echoes it


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``."""
    if not ok:
        raise ValueError(message)


def shorten(line: str) -> str:
    """``line`` with every run of more than :data:`LONGEST_WORD` non-space characters
    cut to its first 80, as the settings' errors cut a value: a 100,000-character
    argument echoed in full buried the one line that names it."""
    def cut(found: re.Match[str]) -> str:
        value = found.group().rstrip(":;,.")  # the punctuation after it stays
        return f"{value[:80]}... ({len(value):,} characters){found.group()[len(value):]}"

    return re.sub(rf"\S{{{LONGEST_WORD + 1},}}", cut, line)
