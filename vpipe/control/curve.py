"""Optional CURVE authentication and encryption of the control plane.

On several hosts the control sockets listen on a network interface, where anyone who can
reach the port could otherwise inject stats or plans. With CURVE on, every inbox is a
CURVE server that admits only clients whose public key is listed (a ZAP handler on the
process's zmq context), and every outbox is a CURVE client that only connects to a server
whose public key is listed, so both ends are authenticated and the traffic is encrypted.

Configured by environment variables, so ``torchrun`` passes it to every rank and the
planner daemon inherits it (read with the others into :class:`~vpipe.settings.Settings`,
once, where vpipe starts); both or neither must be set:

``VPIPE_CURVE_SECRET_FILE``
    this host's key pair (``NAME.key_secret`` from ``vpipe keys``, mode 0600); its public
    key is always trusted.
``VPIPE_CURVE_PUBLIC_KEYS``
    the public keys admitted: files and/or directories of ``*.key`` files, separated by
    ``os.pathsep`` (``:``).

A rank publishes its server's public key in the TCPStore next to its endpoint
(``vpipe/ctl/key/<rank>``); the store is not trusted for this: a key that is not listed
is refused.

Without those, a run still authenticates its control plane, at no cost to the user: a key
pair made for the run (``VPIPE_CURVE_RUN_SECRET``: by ``vpipe train``'s launcher, or under
torchrun by stage 0, handed to the other ranks through a private file, never through the
rendezvous store: see ``run_key.py``) is shared by its
ranks and its planner daemon, and is the only key they admit. A process without it cannot
complete a handshake, so it cannot inject stats, plans or a ``hello``. To attach a planner
daemon by hand, the last stage writes the secret to a file only its user can read
(``VPIPE_CURVE_RUN_SECRET_FILE``) and logs the command that uses it. CURVE is off only
where this libzmq lacks it, or across hosts without a key given (with a warning).

One attach's keys are a :class:`RunKeys`: the settings, the secret agreed at attach, and
the private file made for a daemon started by hand. It hands them to the sockets and, as an
environment of their own, to the daemon it starts; nothing is written to this process's
environment, so a second attach in the process agrees on a key of its own.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import tempfile
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from vpipe.control.keys import KeyFileError, public_keys_from, read_secret_file
from vpipe.settings import Settings

log = logging.getLogger("vpipe.control")

__all__ = ["SECRET_ENV", "PUBLIC_ENV", "RUN_SECRET_ENV", "RUN_SECRET_FILE_ENV", "CurveConfig", "curve_from_env",
           "RunKeys", "CurveGuard", "log_due", "new_run_secret", "private_key_file", "remove_private_key_file",
           "remove_private_key_files"]

SECRET_ENV = "VPIPE_CURVE_SECRET_FILE"
PUBLIC_ENV = "VPIPE_CURVE_PUBLIC_KEYS"
RUN_SECRET_ENV = "VPIPE_CURVE_RUN_SECRET"
RUN_SECRET_FILE_ENV = "VPIPE_CURVE_RUN_SECRET_FILE"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)


def new_run_secret() -> str | None:
    """A fresh CURVE secret key (Z85) for one run, or None when this libzmq has no CURVE."""
    if not zmq.has("curve"):
        return None
    return zmq.curve_keypair()[1].decode("ascii")


_PRIVATE_FOLDERS: list[str] = []  # the key folders this process made, removed at exit


_FOLDER_PREFIX = "vpipe-run-"


def private_key_file(secret: str) -> str:
    """Write ``secret`` to a new file, 0600 in a new 0700 directory, both removed when this process exits.

    A process killed outright (SIGTERM, SIGKILL, a crash) cannot remove its folder; the folder's
    name holds its pid, and every new one first removes this user's folders whose process is gone.
    """
    _remove_orphaned_folders()
    folder = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")  # mode 0700
    if not _PRIVATE_FOLDERS:
        atexit.register(remove_private_key_files)
    _PRIVATE_FOLDERS.append(folder)
    path = os.path.join(folder, "control.key_secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return path


def _remove_orphaned_folders() -> None:
    """Remove this user's key folders (``vpipe-run-PID-*``) whose process no longer runs."""
    base = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(base) if n.startswith(_FOLDER_PREFIX)]
    except OSError:
        return
    for name in names:
        pid_text = name[len(_FOLDER_PREFIX):].partition("-")[0]
        path = os.path.join(base, name)
        try:
            info = os.lstat(path)
            if not (pid_text.isdigit() and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()):
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def remove_private_key_file(path: str) -> None:
    """Remove the key folder :func:`private_key_file` made for ``path`` (and only it)."""
    folder = os.path.dirname(path)
    if folder in _PRIVATE_FOLDERS:
        _PRIVATE_FOLDERS.remove(folder)
        shutil.rmtree(folder, ignore_errors=True)


def remove_private_key_files() -> None:
    """Remove every key folder this process made (at exit, including the fast exits that skip ``atexit``).

    The list is the process's, not an attach's: whoever made a folder, none may outlive the process."""
    while _PRIVATE_FOLDERS:
        shutil.rmtree(_PRIVATE_FOLDERS.pop(), ignore_errors=True)


def log_due(n: int, first: int = 100, every: int = 1000) -> bool:
    """Log the ``n``-th occurrence? The first ``first`` ones, then one in ``every``: floods stay short."""
    return n <= first or n % every == 0


@dataclass(frozen=True)
class CurveConfig:
    """This process's CURVE key pair and the public keys it trusts (all Z85)."""

    public: bytes
    secret: bytes
    trusted: frozenset[bytes]

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike[str], public_keys: list[str]) -> CurveConfig:
        """Read and check the key files; :class:`KeyFileError` names the file that is wrong."""
        if not zmq.has("curve"):
            raise KeyFileError("this libzmq was built without CURVE support; the control plane cannot encrypt")
        public, secret = read_secret_file(secret_file)
        trusted = set(public_keys_from(public_keys))
        trusted.add(public)
        return cls(public=public, secret=secret, trusted=frozenset(trusted))

    def check_server_key(self, key: bytes | str | None, peer: str) -> bytes:
        """``key`` if it is a trusted public key; ValueError naming ``peer`` otherwise."""
        if key is None:
            raise ValueError(f"{peer} published no CURVE key, but CURVE is on here ({SECRET_ENV}): "
                             f"start every process of the run with the same CURVE settings")
        data = key.encode("ascii", "replace") if isinstance(key, str) else bytes(key)
        if data not in self.trusted:
            raise ValueError(f"{peer} presents CURVE key {data[:40].decode('ascii', 'replace')!r}, which is not "
                             f"among the trusted keys ({PUBLIC_ENV}); refusing to connect")
        return data

    def make_server(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.public)

    def make_client(self, socket: zmq.Socket, server_key: bytes) -> None:
        socket.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


def curve_from_env(environ: Mapping[str, str] | None = None) -> CurveConfig | None:
    """The CURVE configuration ``environ`` (default: this process's environment) asks for, None when CURVE is
    off; errors name the problem. (For a process that has no settings of its own: an attach hands its own on.)"""
    return RunKeys(Settings.read(environ)).curve()


class RunKeys:
    """One attach's (or one command's) CURVE keys: the key files the settings name, or the run's secret (given
    in the settings, or agreed at attach by :func:`~vpipe.control.run_key.agree_run_key`), and the private
    file holding it that a daemon started by hand reads (made when first asked for, removed by :meth:`close`)."""

    def __init__(self, settings: Settings, secret: str | None = None) -> None:
        self.settings = settings
        self._agreed = secret
        self._file: str | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> RunKeys:
        return cls(Settings.read(environ))

    @property
    def by_files(self) -> bool:
        """Whether the user set up CURVE with key files (then no run key is made)."""
        return bool(self.settings.curve_secret_file or self.settings.curve_public_keys)

    @property
    def given(self) -> bool:
        """Whether the launcher or the user gave the run's secret (or a file holding it)."""
        return bool(self.settings.curve_run_secret or self.settings.curve_run_secret_file)

    @property
    def secret(self) -> str:
        """The run's secret as text: agreed at attach, or given; "" when neither."""
        return self._agreed or self.settings.curve_run_secret

    def agree(self, secret: str) -> None:
        """The secret the ranks agreed on at attach: this run's from now on."""
        self._agreed = secret

    def curve(self) -> CurveConfig | None:
        """The CURVE configuration these keys make, None when CURVE is off; errors name the problem."""
        settings = self.settings
        if not self.by_files:
            return self._run_config()
        if not settings.curve_secret_file:
            raise KeyFileError(f"{PUBLIC_ENV} is set but {SECRET_ENV} is not: CURVE needs this host's secret key "
                               "file")
        if not settings.curve_public_keys:
            raise KeyFileError(f"{SECRET_ENV} is set but {PUBLIC_ENV} is not: CURVE needs the public keys to admit")
        return CurveConfig.from_files(Path(settings.curve_secret_file), list(settings.curve_public_keys))

    def _run_config(self) -> CurveConfig | None:
        secret_text = self.secret
        if not secret_text and self.settings.curve_run_secret_file:  # a bare key or a `vpipe keys` secret file
            secret_text = read_secret_file(self.settings.curve_run_secret_file)[1].decode("ascii")
        if not secret_text or not zmq.has("curve"):
            return None
        try:
            secret = secret_text.encode("ascii")
            public = zmq.curve_public(secret)
        except (UnicodeEncodeError, ValueError, zmq.ZMQError) as e:
            raise KeyFileError(f"{RUN_SECRET_ENV} is not a CURVE secret key ({e})") from None
        return CurveConfig(public=public, secret=secret, trusted=frozenset({public}))

    def secret_file(self) -> str | None:
        """A file only this user can read holding the run's secret, for a daemon started by hand: the one the
        settings name, else one made now (once); None without a run secret."""
        if self.settings.curve_run_secret_file:
            return self.settings.curve_run_secret_file
        if self._file is None and self.secret:
            self._file = private_key_file(self.secret)
        return self._file

    def child_env(self) -> dict[str, str]:
        """What a process this one starts (the planner daemon) needs in its environment to hold the same keys,
        beyond what it inherits: the secret agreed at attach."""
        return {RUN_SECRET_ENV: self._agreed} if self._agreed else {}

    def close(self) -> None:
        """Remove the key file :meth:`secret_file` made (not another attach's)."""
        if self._file is not None:
            remove_private_key_file(self._file)
            self._file = None


class CurveGuard:
    """The ZAP handler of one zmq context: admits CURVE clients with a trusted key, logs the others.

    It binds the context's ZAP endpoint at once: it must exist before the context's first
    CURVE server binds, since without a ZAP handler libzmq admits every client. The requests
    are answered by :meth:`serve`, on the thread of the inbox's
    :class:`~vpipe.control.doorman.Doorman`, which first takes note of every connection the
    inbox accepted (and cuts those over its caps), so none over them ever authenticates.
    """

    def __init__(self, context: zmq.Context, config: CurveConfig, *, name: str) -> None:
        self.config = config
        self.name = name
        self.refused: Counter = Counter()  # client public key -> refusals
        self._lock = threading.Lock()
        self.zap_socket = context.socket(zmq.REP)
        self.zap_socket.setsockopt(zmq.LINGER, 0)
        self.zap_socket.setsockopt(zmq.MAXMSGSIZE, 4096)  # a ZAP request is a few short frames
        self.zap_socket.bind(ZAP_ENDPOINT)

    def serve(self) -> None:
        """Answer every waiting ZAP request (RFC 27); only ever called on one thread."""
        while int(self.zap_socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                request = self.zap_socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.zap_socket.send_multipart(self._answer(request))

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6 or request[0] != b"1.0":
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        request_id, domain, mechanism, credentials = request[1], request[2], request[5], request[6:]
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            return [b"1.0", request_id, b"400", b"CURVE only", b"", b""]
        key = z85.encode(credentials[0])
        if not self.callback(domain.decode("utf-8", "replace"), key):
            return [b"1.0", request_id, b"400", b"untrusted key", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", key, b""]

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: is this client's public key trusted? (called on the thread that serves the guard)"""
        if key in self.config.trusted:
            return True
        with self._lock:
            self.refused[key] += 1
            n = self.refused[key]
        if log_due(n):
            log.warning("%s: refused a CURVE client with an untrusted public key %s (%d time%s)",
                        self.name, key.decode("ascii", "replace"), n, "" if n == 1 else "s")
        return False

    def close(self) -> None:
        self.zap_socket.close(linger=0)


def handshake_failure(event: int, value: int) -> str | None:
    """The reason a monitored handshake failed, in vpipe's words; None for other events."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "untrusted_key"  # ZAP said no (status code in value, 400)
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return _PROTOCOL_REASONS.get(value, "protocol_error")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "handshake_failed"
    return None


_PROTOCOL_REASONS: dict[int, str] = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "mechanism_mismatch",  # e.g. a client without CURVE
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "cryptographic",  # e.g. a client using the wrong server key
}

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
