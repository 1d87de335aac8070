"""The files users name, read and written safely.

Reading: regular files only, never more than a bound. ``st_size`` is 0 for ``/dev/zero`` and
for a FIFO, so a reader that trusts it reads a device until memory runs out, or waits forever
for a FIFO's writer. Every path vpipe reads goes through :func:`read_regular` instead: it opens
without blocking, checks what it opened is a regular file, and reads at most ``limit`` bytes
plus one to tell a file that is too big.

Writing: never through a link another user planted. A directory vpipe writes in may be shared
(a world-writable ``shared/ck``), and a symbolic link at a name vpipe opens would hand the write
to the link's target. So a new file is made under a name nobody can guess with ``O_CREAT |
O_EXCL | O_NOFOLLOW`` (:func:`create_new`) and renamed over the name it replaces
(:func:`replacing`, :func:`write_atomic`: a link there is replaced, never followed); a file
vpipe keeps open (a lock, a run log) is opened with ``O_NOFOLLOW`` (:func:`open_lock`,
:func:`open_append`; a run log may still be a link of this user's, in a directory only they can
change); and a directory for secrets is made ``0700`` whatever the umask (:func:`make_private_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["FileCheckError", "read_regular", "open_regular", "check_regular", "check_output_file", "check_output_dir",
           "create_new", "replacing", "write_atomic", "open_append", "open_lock", "make_private_dir", "planted_link"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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
    reason = planted_link(text)
    if reason is not None:
        raise FileCheckError(f"{what} {text} is {reason}; vpipe does not write through it: name the file it "
                             "points to")
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


# ====================================================================== writing
def planted_link(path: str | os.PathLike[str]) -> str | None:
    """Why the symbolic link ``path`` may be another user's (the text says what it is), or None when it is not a
    link or only this user (or root) could have put it there: the link and its directory are theirs, and nobody
    else can change the directory (or it is sticky, as /tmp is)."""
    try:
        link = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISLNK(link.st_mode):
        return None
    trusted = (os.geteuid(), 0)
    if link.st_uid not in trusted:
        return f"a symbolic link another user made (uid {link.st_uid})"
    try:
        parent = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return "a symbolic link in a directory vpipe cannot check"
    shared = parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not parent.st_mode & stat.S_ISVTX
    if parent.st_uid not in trusted or shared:
        return "a symbolic link in a directory other users can change"
    return None


def create_new(directory: str | os.PathLike[str], prefix: str, suffix: str = ".tmp",
               mode: int = 0o666) -> tuple[int, str]:
    """A new file in ``directory`` for this process alone, and its path: made under a name nobody can guess with
    ``O_CREAT | O_EXCL | O_NOFOLLOW``, so nothing planted there (a link, another user's file) is ever opened.
    ``mode`` is narrowed by the umask, as ``open`` does."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
    for _ in range(100):
        path = os.path.join(os.fspath(directory), f"{prefix}{secrets.token_hex(8)}{suffix}")
        try:
            return os.open(path, flags, mode), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name in {os.fspath(directory)}")


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], *, fsync: bool = False) -> Iterator[BinaryIO]:
    """A binary file to write what ``path`` will hold: a new temporary beside it (:func:`create_new`), renamed over
    ``path`` when the block ends. A link at ``path`` is replaced, never followed; a reader sees the old file or the
    whole new one; a failure (a full disk, Ctrl-C) removes the temporary and raises."""
    text = os.fspath(path)
    fd, tmp = create_new(os.path.dirname(os.path.abspath(text)), f".{os.path.basename(text)}.")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, text)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike[str], data: bytes, *, fsync: bool = False) -> None:
    """``data`` as the whole of ``path``, through :func:`replacing`."""
    with replacing(path, fsync=fsync) as f:
        f.write(data)


def open_append(path: str | os.PathLike[str], what: str = "file") -> int:
    """A descriptor appending to ``path`` (made if missing), for a file many writers share (a run log): opened with
    ``O_NOFOLLOW`` unless the link is this user's own (:func:`planted_link`), and only a regular file or a device
    (``/dev/null``, ``/dev/full``); FileCheckError names what is wrong."""
    text = os.fspath(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _CLOEXEC
    try:
        try:
            fd = os.open(text, flags | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            if e.errno != errno.ELOOP or not os.path.islink(text):
                raise
            reason = planted_link(text)
            if reason is not None:
                raise FileCheckError(f"{what} {text} is {reason}; vpipe does not write through it: name the file "
                                     "it points to") from None
            fd = os.open(text, flags, 0o666)
    except OSError as e:
        raise FileCheckError(f"cannot write {what} {text}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
        os.close(fd)
        raise FileCheckError(f"{what} {text} is {_describe(mode)}, not a file to write to")
    os.set_blocking(fd, True)
    return fd


def open_lock(path: str | os.PathLike[str], what: str = "lock file") -> int:
    """A read-write descriptor of the lock file ``path`` (made if missing), never through a link: a regular file
    with no other name (a hard link would hand its writes to another file); FileCheckError otherwise, OSError when
    it cannot be opened."""
    text = os.fspath(path)
    try:
        fd = os.open(text, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(text):
            raise FileCheckError(f"{what} {text} is a symbolic link; vpipe never writes through one") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        kind = _describe(info.st_mode) if not stat.S_ISREG(info.st_mode) else "a file with other names (hard links)"
        raise FileCheckError(f"{what} {text} is {kind}; vpipe never writes through one")
    os.set_blocking(fd, True)
    return fd


def make_private_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory ``path`` (and its parents) ``0700`` whatever the umask; one that exists is left as it is.
    OSError when it cannot be made."""
    text = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(text, 0o700)
    except FileExistsError:
        if os.path.isdir(text):
            return
        raise
    fd = os.open(text, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC)  # the one just made, not a link
    try:
        os.fchmod(fd, 0o700)  # the umask may have narrowed it past use (umask 0o777)
    finally:
        os.close(fd)
