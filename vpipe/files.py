"""The files users name, read and written safely.

Reading: regular files only, never more than a bound. ``st_size`` is 0 for ``/dev/zero`` and
for a FIFO, so a reader that trusts it reads a device until memory runs out, or waits forever
for a FIFO's writer. Every path vpipe reads goes through :func:`read_regular` instead: it opens
without blocking, checks what it opened is a regular file, and reads at most ``limit`` bytes
plus one to tell a file that is too big.

Writing: never through a link another user planted, and private. A directory vpipe writes in may
be shared (a world-writable ``shared/ck``), and a symbolic link at a name vpipe opens would hand
the write to the link's target. So a directory is reached one component at a time from the root
(:func:`open_dir`), following a link only where this user (or root) made it and nobody else can
change it (:func:`planted_link`), and every file is made in the descriptor it got: a new file
under a name nobody can guess with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (:func:`create_new`),
renamed over the name it replaces (:func:`replacing`, :func:`write_atomic`: a link there is
replaced, never followed; a command's output refuses a planted one in one line,
:func:`write_output`); a file vpipe keeps open (a lock, a run log) is opened with
``O_NOFOLLOW`` (:func:`open_lock`, :func:`open_append`; a run log may still be a link of this
user's, in a directory only they can change). What vpipe makes is this user's alone, whatever
the umask (a umask of 000 made checkpoints and logs 0666): files ``0600``, directories ``0700``
(:func:`make_dirs`, :func:`make_private_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["FileCheckError", "read_regular", "open_regular", "check_regular", "describe_mode", "check_links",
           "create_new", "replacing", "write_atomic", "write_output", "output_file", "open_append",
           "open_lock",
           "open_dir", "make_dirs", "make_private_dir", "planted_link", "PlantedLinkError", "FILE_MODE",
           "DIR_MODE"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC
FILE_MODE, DIR_MODE = 0o600, 0o700  # what vpipe makes: this user's alone, whatever the umask


class FileCheckError(ValueError):
    """A path that is not a readable regular file of a sane size; the message names it."""


class PlantedLinkError(FileCheckError, OSError):
    """A symbolic link another user could have planted where vpipe would write: a ValueError where a path
    is checked (one line, exit 2), an OSError where a write meets it later (said once, as a full disk is)."""


def describe_mode(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
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
        raise FileCheckError(f"{what} {os.fspath(path)} is {describe_mode(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: str | os.PathLike[str], limit: int, what: str = "file", *,
                 nofollow: bool = False) -> bytes:
    """The contents of the regular file ``path``, at most ``limit``
    bytes; FileCheckError names what is wrong."""
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


def check_links(directory: str, text: str, what: str) -> None:
    """PlantedLinkError when a component of the absolute ``directory`` that exists is
    a link another user could have planted (:func:`planted_link`): checked at
    start (:mod:`vpipe.output_paths`), where :func:`open_dir` would refuse it later."""
    walked = os.sep
    for part in directory.split(os.sep):
        walked = os.path.join(walked, part)
        if part and os.path.islink(walked):
            _refuse_link(walked, text, what)


def _refuse_link(link: str, text: str, what: str) -> None:
    reason = planted_link(link)
    if reason is not None:
        where = f"{what} {text}" if link == os.path.abspath(text) else f"{what} {text}: {link}"
        raise PlantedLinkError(f"{where} is {reason}; vpipe does not write through it: remove it, or "
                               "name another directory")


# ====================================================================== writing
def planted_link(path: str | os.PathLike[str]) -> str | None:
    """Why the symbolic link ``path`` may be another user's (the text says what it is), or None when it is
    not a link or only this user (or root) could have put it there: the link and its directory are theirs,
    and nobody else can change the directory (or it is sticky, as /tmp is)."""
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


def open_dir(path: str | os.PathLike[str], what: str = "directory", *, create: bool = False) -> int:
    """A descriptor of the directory ``path``, reached one component at a time from the root: a
    component that is a symbolic link is followed only where :func:`planted_link` finds nobody else
    could have put it (a link planted anywhere on the way would take vpipe's files into another user's
    directory), FileCheckError naming it otherwise. ``create`` makes the missing directories ``0700``
    whatever the umask. OSError when one cannot be opened."""
    text = os.path.abspath(os.fspath(path))
    fd, walked = os.open(os.sep, _DIR), os.sep
    try:
        for part in filter(None, text.split(os.sep)):
            walked = os.path.join(walked, part)
            inner = _open_part(fd, part, walked, os.fspath(path), what, create)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_part(fd: int, part: str, walked: str, text: str, what: str, create: bool) -> int:
    """One component of :func:`open_dir`'s walk, in the directory ``fd``."""
    try:
        return os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(part, DIR_MODE, dir_fd=fd)
        except FileExistsError:  # made meanwhile: opened as any other
            return _open_part(fd, part, walked, text, what, False)
        made = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
        os.fchmod(made, DIR_MODE)  # a umask of 0o777 would leave it unusable
        return made
    except NotADirectoryError:  # a file, or (with O_NOFOLLOW) a symbolic link
        if not stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
            raise
        _refuse_link(walked, text, what)
        return os.open(part, _DIR, dir_fd=fd)  # this user's own link, where nobody else can change it


def make_dirs(path: str | os.PathLike[str], what: str = "directory") -> None:
    """The directory ``path``, made with its missing parents ``0700`` (:func:`open_dir`); one that exists
    is left as it is. FileCheckError for a planted link on the way, OSError when it cannot be made."""
    os.close(open_dir(path, what, create=True))


def make_private_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory ``path`` (and its parents) ``0700`` whatever the umask; one that
    exists is left as it is. OSError when it cannot be made."""
    make_dirs(path, "key directory")


def create_new(directory: str | os.PathLike[str], prefix: str, suffix: str = ".tmp", mode: int = FILE_MODE, *,
               dir_fd: int | None = None) -> tuple[int, str]:
    """A new file in ``directory`` (or the directory ``dir_fd``, ``directory`` then only naming it)
    for this process alone, and its name there: made under a name nobody can guess with ``O_CREAT |
    O_EXCL | O_NOFOLLOW``, so nothing planted there (a link, another user's file) is ever opened.
    ``mode`` is narrowed by the umask, as ``open`` does."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(8)}{suffix}"
        path = name if dir_fd is not None else os.path.join(os.fspath(directory), name)
        try:
            return os.open(path, flags, mode, dir_fd=dir_fd), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name in {os.fspath(directory)}")


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], *, fsync: bool = False, what: str = "file") -> Iterator[BinaryIO]:
    """A binary file to write what ``path`` will hold: a new temporary beside it
    (:func:`create_new`, in the directory :func:`open_dir` reached), renamed over ``path`` when the
    block ends. A link at ``path`` is replaced, never followed; a reader sees the old file or the
    whole new one; a failure (a full disk, Ctrl-C) removes the temporary and raises. ``fsync``: the
    file and the directory's entry reach the disk before it returns."""
    text = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(text))
    dir_fd = open_dir(directory, what)
    try:
        fd, tmp = create_new(directory, f".{name}.", dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        if fsync:
            with contextlib.suppress(OSError):
                os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_atomic(path: str | os.PathLike[str], data: bytes, *, fsync: bool = False,
                 what: str = "file") -> None:
    """``data`` as the whole of ``path``, through :func:`replacing`."""
    with replacing(path, fsync=fsync, what=what) as f:
        f.write(data)


@contextlib.contextmanager
def output_file(path: str | os.PathLike[str], what: str) -> Iterator[BinaryIO]:
    """A command's output file (``-o``, ``--png``, ``--json``, ``--save-graph``), written through
    :func:`replacing`: a link another user could have planted at ``path`` or on the way to it is refused,
    one of this user's replaced (written through only to a device: ``-o /dev/stdout``). FileCheckError (one
    line, naming ``what``) for a refusal or a write that fails."""
    text = os.fspath(path)
    check_links(os.path.dirname(os.path.abspath(text)), text, what)
    reason = planted_link(text)
    if reason is not None:
        raise PlantedLinkError(f"{what} {text} is {reason}; vpipe does not write through "
                               "it: remove it, or name another file")
    try:
        try:
            mode: int | None = os.stat(text).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            raise FileCheckError(f"{what} {text} is {describe_mode(mode)}, not a file to write")
        if mode is not None and stat.S_ISCHR(mode):  # /dev/null, /dev/stdout: written to, never replaced
            with open(text, "wb") as device:
                yield device
        else:
            with replacing(text, what=what) as f:
                yield f
    except PlantedLinkError:
        raise
    except OSError as e:
        raise FileCheckError(f"cannot write {what} {text}: {e.strerror or e}") from None


def write_output(path: str | os.PathLike[str], data: bytes, what: str) -> None:
    """``data`` as the whole of the command's output ``path``, through :func:`output_file`."""
    with output_file(path, what) as f:
        f.write(data)


def open_append(path: str | os.PathLike[str], what: str = "file") -> int:
    """A descriptor appending to ``path`` (made ``0600`` if missing), for a file many writers share
    (a run log): in the directory :func:`open_dir` reached, opened with ``O_NOFOLLOW`` unless the
    link is this user's own (:func:`planted_link`), and only a regular file or a device
    (``/dev/null``, ``/dev/full``); FileCheckError names what is wrong."""
    text = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(text))
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _CLOEXEC
    try:
        dir_fd = open_dir(directory, what)
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW, FILE_MODE, dir_fd=dir_fd)
        except OSError as e:
            if e.errno != errno.ELOOP or not os.path.islink(text):
                raise
            reason = planted_link(text)
            if reason is not None:
                raise PlantedLinkError(f"{what} {text} is {reason}; vpipe does not write "
                                       "through it: remove it, or name another file") from None
            fd = os.open(name, flags, FILE_MODE, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except PlantedLinkError:
        raise
    except OSError as e:
        raise FileCheckError(f"cannot write {what} {text}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
        os.close(fd)
        raise FileCheckError(f"{what} {text} is {describe_mode(mode)}, not a file to write to")
    os.set_blocking(fd, True)
    return fd


def open_lock(path: str | os.PathLike[str], what: str = "lock file") -> int:
    """A read-write descriptor of the lock file ``path`` (made ``0600`` if missing), never through a link:
    a regular file with no other name (a hard link would hand its writes to another file); FileCheckError
    otherwise, OSError when it cannot be opened."""
    text = os.fspath(path)
    try:
        fd = os.open(text, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(text):
            raise FileCheckError(
                f"{what} {text} is a symbolic link; vpipe never writes through one"
            ) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        kind = (describe_mode(info.st_mode) if not stat.S_ISREG(info.st_mode)
                else "a file with other names (hard links)")
        raise FileCheckError(f"{what} {text} is {kind}; vpipe never writes through one")
    os.set_blocking(fd, True)
    return fd
