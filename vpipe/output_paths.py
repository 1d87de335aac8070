"""The output paths a run or a command will write, checked when it starts rather than when it ends.

A run that trains for an hour and then cannot write its log, or a command whose ``-o`` names a directory,
should fail at once, in one line that names the path: :func:`check_output_file` (a file to append to or
replace) and :func:`check_output_dir` (a directory to write in, and the names vpipe will write there) say
what is wrong before anything runs. They refuse what :mod:`vpipe.files` would refuse at the write (a link
another user could have planted on the way, a FIFO, a directory that cannot be made), and make nothing:
the files themselves are made, later, by :mod:`vpipe.files`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

from vpipe.files import FileCheckError, PlantedLinkError, check_links, describe_mode, planted_link

__all__ = ["check_output_file", "check_output_dir"]


def check_output_file(path: str | os.PathLike[str], what: str) -> None:
    """FileCheckError unless ``path`` can be a file to append to: not empty, not a directory or a FIFO, in a
    directory that exists (or can be made) and, if it exists, writable. Checked at start, not at the end."""
    text, mode = _existing(path, what, "a file name")
    reason = planted_link(text)
    if reason is not None:
        raise PlantedLinkError(f"{what} {text} is {reason}; vpipe does not write through "
                               "it: remove it, or name another file")
    check_links(os.path.dirname(os.path.abspath(text)), text, what)
    if mode is None:
        return
    if stat.S_ISDIR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise FileCheckError(f"{what} {text} is {describe_mode(mode)}, not a file to write to")
    if not os.access(text, os.W_OK):
        raise FileCheckError(f"cannot write {what} {text}: permission denied")


def check_output_dir(path: str | os.PathLike[str], what: str, names: Iterable[str] = ()) -> None:
    """FileCheckError unless ``path`` is a writable directory or one that can be made, reached through no link
    another user could have planted, and holding none at the ``names`` vpipe will write there."""
    text, mode = _existing(path, what, "a directory")
    check_links(os.path.abspath(text), text, what)
    if mode is None:
        return
    if not stat.S_ISDIR(mode):
        kind = describe_mode(mode) if not stat.S_ISREG(mode) else "a file"
        raise FileCheckError(f"{what} {text} is {kind}, not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise FileCheckError(f"cannot write in {what} {text}: permission denied")
    for name in names:
        reason = planted_link(os.path.join(text, name))
        if reason is not None:
            raise PlantedLinkError(f"{what} {text}: {os.path.join(text, name)} is {reason}; vpipe does not "
                                   "write through it: remove it, or give this run a directory of its own")


def _existing(path: str | os.PathLike[str], what: str, wanted: str) -> tuple[str, int | None]:
    """(path, its mode) if it exists; (path, None) when it is still to be made, where it can be."""
    text = os.fspath(path)
    if not text.strip():
        raise FileCheckError(f"{what} is empty; give {wanted}")
    try:
        return text, os.stat(text).st_mode
    except (FileNotFoundError, NotADirectoryError):
        _check_parent(text, what)
        return text, None
    except OSError as e:
        raise FileCheckError(f"{what} {text}: {e.strerror or e}") from None


def _check_parent(text: str, what: str) -> None:
    """The nearest existing ancestor of a path still to be made must be a writable directory."""
    parent = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise FileCheckError(f"{what} {text}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FileCheckError(f"cannot create {what} {text}: {parent} is not writable")
