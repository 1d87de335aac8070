"""Reading the files users name, safely: regular files only, never more than a bound.

``st_size`` is 0 for ``/dev/zero`` and for a FIFO, so a reader that trusts it reads a device
until memory runs out, or waits forever for a FIFO's writer. Every path vpipe reads goes
through :func:`read_regular` instead: it opens without blocking, checks what it opened is a
regular file, and reads at most ``limit`` bytes plus one to tell a file that is too big.
"""

from __future__ import annotations

import os
import stat

__all__ = ["FileCheckError", "read_regular", "open_regular", "check_regular", "check_output_file", "check_output_dir"]


class FileCheckError(ValueError):
    """A path that is not a readable regular file of a sane size; the message names it."""


def _describe(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], what: str = "file", *, nofollow: bool = False) -> int:
    """A descriptor of ``path`` opened for reading, if it is a regular file; FileCheckError otherwise.

    Opened with ``O_NONBLOCK`` (a FIFO does not wait for a writer) and checked with ``fstat``
    on what was opened, so the check and the read see the same file.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (os.O_NOFOLLOW if nofollow else 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileCheckError(f"{what} {os.fspath(path)} does not exist") from None
    except OSError as e:
        raise FileCheckError(f"cannot read {what} {os.fspath(path)}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileCheckError(f"{what} {os.fspath(path)} is {_describe(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: str | os.PathLike[str], limit: int, what: str = "file", *, nofollow: bool = False) -> bytes:
    """The contents of the regular file ``path``, at most ``limit`` bytes; FileCheckError names what is wrong."""
    fd = open_regular(path, what, nofollow=nofollow)
    try:
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise FileCheckError(f"cannot read {what} {os.fspath(path)}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise FileCheckError(f"{what} {os.fspath(path)} is over the {limit}-byte limit")
    return b"".join(chunks)


def check_regular(path: str | os.PathLike[str], what: str = "file") -> None:
    """FileCheckError unless ``path`` is a regular file this process can open for reading."""
    os.close(open_regular(path, what))


def check_output_file(path: str | os.PathLike[str], what: str) -> None:
    """FileCheckError unless ``path`` can be a file to append to: not empty, not a directory or a FIFO, in a
    directory that exists (or can be made) and, if it exists, writable. Checked at start, not at the end."""
    text, mode = _existing(path, what, "a file name")
    if mode is None:
        return
    if stat.S_ISDIR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise FileCheckError(f"{what} {text} is {_describe(mode)}, not a file to write to")
    if not os.access(text, os.W_OK):
        raise FileCheckError(f"cannot write {what} {text}: permission denied")


def check_output_dir(path: str | os.PathLike[str], what: str) -> None:
    """FileCheckError unless ``path`` is a writable directory or one that can be made."""
    text, mode = _existing(path, what, "a directory")
    if mode is None:
        return
    if not stat.S_ISDIR(mode):
        raise FileCheckError(f"{what} {text} is {_describe(mode) if not stat.S_ISREG(mode) else 'a file'}, "
                             f"not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise FileCheckError(f"cannot write in {what} {text}: permission denied")


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
