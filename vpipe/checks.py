"""The one way a configuration says what is wrong with it: ``ValueError`` with a message that names the field."""

from __future__ import annotations

__all__ = ["require"]


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``."""
    if not ok:
        raise ValueError(message)
