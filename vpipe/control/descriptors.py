"""An inbox's file descriptors: the process's open-file limit, and connections seen through duplicates.

zmq accepts every TCP connection to a bound socket and owns its descriptor; the inbox's
:class:`~vpipe.control.doorman.Doorman` only ever looks at a connection (its peer, what the
kernel says was sent on it) or cuts it through a duplicate of that descriptor, checked to be the
same connection, since the number may have been reused once zmq closed it. Near the open-file
limit even the duplicate may fail, so a reserve descriptor is kept open and given up to make room
for one. The process raises its soft ``RLIMIT_NOFILE`` to the hard limit before an inbox opens
(:func:`raise_open_file_limit`). Apart from the doorman because this is the operating system's
side of a connection, which the doorman's rules (who is cut, who waits) need not know.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("vpipe.control")

__all__ = ["ConnectionDescriptors", "raise_open_file_limit"]

_T = TypeVar("_T")


def raise_open_file_limit() -> tuple[int, int] | None:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard
    limit; (before, after), or None when unchanged."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:  # e.g. macOS refuses more than OPEN_MAX under an unlimited hard limit
        log.debug("could not raise the open-file limit from %d to %d: %s", soft, target, e)
        return None
    log.info("raised the open-file limit (RLIMIT_NOFILE) from %d to %d, the hard limit", soft, target)
    return soft, target


class ConnectionDescriptors:
    """The connections of the socket bound to ``port``, each looked at through a duplicate of its
    descriptor; a reserve descriptor makes room for the duplicate at the open-file limit.

    Made before the socket binds (so the reserve is there before the first connection), given
    the bound ``port`` once known, and closed with its owner.
    """

    def __init__(self) -> None:
        self.port = 0
        self._reserve = _open_reserve()  # closed to make room for a duplicate at the open-file limit

    def peer(self, fd: int) -> Any:
        """The peer address of connection ``fd`` if it is one of this socket's, else None."""
        sock = self._duplicate(fd)
        try:
            return sock.getpeername() if sock is not None and sock.getsockname()[1] == self.port else None
        except (OSError, IndexError, TypeError):
            return None
        finally:
            self._release(sock)

    def on(self, fd: int, peer: Any, act: Callable[[socket.socket], _T]) -> tuple[bool, _T | None]:
        """``act`` on connection ``fd`` if it is still the one to ``peer`` (the duplicate pins it: its
        number may have been reused since); (False, None) when it is gone."""
        sock = self._duplicate(fd)
        try:
            same = sock is not None and sock.getsockname()[1] == self.port and sock.getpeername() == peer
            result = act(sock) if same and sock is not None else None
        except (OSError, IndexError, TypeError):
            same, result = False, None
        finally:
            self._release(sock)
        return same, result

    def close(self) -> None:
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None

    def _duplicate(self, fd: int) -> socket.socket | None:
        """A socket object on a duplicate of ``fd``, None when it is closed or no socket."""
        try:
            dup = os.dup(fd)
        except OSError as e:
            if e.errno != errno.EMFILE or self._reserve is None:
                return None
            os.close(self._reserve)  # at the limit: the reserve makes room for the duplicate
            self._reserve = None
            try:
                dup = os.dup(fd)
            except OSError:
                return None
        try:
            return socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            return None

    def _release(self, sock: socket.socket | None) -> None:
        if sock is not None:
            sock.close()  # the duplicate only: zmq's descriptor stays open
        if self._reserve is None:
            self._reserve = _open_reserve()


def _open_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None
