"""CURVE key files: read them strictly, write them with safe permissions (``vpipe keys``).

A key file is either a ZeroMQ certificate (what ``zmq.auth.create_certificates`` and
``vpipe keys`` write: ``public-key = "..."`` and, in the secret file, ``secret-key = "..."``)
or a file holding one bare 40-character Z85 key. Keys are checked where they enter (Z85
alphabet, 32 bytes, a secret matching its public key) so that a bad file fails at start-up
with its name, not later as a handshake that silently never completes. Secret files must
not be readable by group or others, as ssh demands of its keys; ``vpipe keys`` writes them
``0600`` (a directory it makes ``0700``), never through a link, never over a file, and never one
half of a pair without the other.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import stat
from pathlib import Path
from typing import Any

import zmq

from vpipe.files import FileCheckError, make_private_dir, read_regular
from vpipe.output_paths import check_output_dir

__all__ = ["KeyFileError", "read_secret_file", "read_public_file", "public_keys_from", "write_keypair",
           "check_z85_key", "register"]

_Z85 = re.compile(rb"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_LINE = re.compile(rb"^\s*(public-key|secret-key)\s*=\s*\"?([^\"\s]*)\"?\s*$")
_MAX_FILE_BYTES = 64 * 1024  # a certificate is a few hundred bytes; anything big is not one


class KeyFileError(ValueError):
    """A CURVE key file that is missing, unreadable, malformed or too open; the message names it."""


def check_z85_key(key: bytes | str, what: str) -> bytes:
    """``key`` as Z85 bytes if it is a valid 32-byte CURVE key; ValueError naming ``what`` otherwise."""
    data = key.encode("ascii", "replace") if isinstance(key, str) else bytes(key)
    if not _Z85.match(data):
        raise ValueError(f"{what} is not a 40-character Z85 CURVE key")
    return data


def _read(path: Path) -> bytes:
    """The file's bytes: a regular file only, read up to a bound (``st_size`` is 0 for a FIFO or a device)."""
    try:
        return read_regular(path, _MAX_FILE_BYTES, "CURVE key file")
    except FileCheckError as e:
        raise KeyFileError(str(e)) from None


def _parse(path: Path, data: bytes) -> tuple[bytes | None, bytes | None]:
    """(public, secret) found in a certificate, or (None, bare key) for a bare Z85 file."""
    lines = [line.strip() for line in data.splitlines() if line.strip() and not line.strip().startswith(b"#")]
    if len(lines) == 1 and _Z85.match(lines[0]):
        return None, lines[0]
    found: dict[bytes, bytes] = {}
    for line in lines:
        match = _LINE.match(line)
        if match is None:
            continue
        name, value = match.groups()
        if name in found:
            raise KeyFileError(f"CURVE key file {path} has two {name.decode()} lines")
        if not _Z85.match(value):
            raise KeyFileError(f"CURVE key file {path}: its {name.decode()} is not a 40-character Z85 key")
        found[name] = value
    if not found:
        raise KeyFileError(f"CURVE key file {path} holds no key: expected a ZeroMQ certificate "
                           f"(public-key = \"...\") or one 40-character Z85 key")
    return found.get(b"public-key"), found.get(b"secret-key")


def read_secret_file(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of this process from a secret certificate or a bare secret key file."""
    path = Path(path)
    public, secret = _parse(path, _read(path))
    if secret is None:
        raise KeyFileError(f"CURVE key file {path} has a public key only; give the secret file "
                           f"(NAME.key_secret from `vpipe keys`)")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"CURVE secret key file {path} is accessible by group or others "
                           f"(mode {stat.S_IMODE(mode):04o}); run: chmod 600 {path}")
    derived = zmq.curve_public(secret)
    if public is not None and public != derived:
        raise KeyFileError(f"CURVE key file {path}: its public-key does not belong to its secret-key")
    return derived, secret


def read_public_file(path: str | os.PathLike[str]) -> bytes:
    """The Z85 public key in a public certificate or a bare public key file."""
    path = Path(path)
    public, secret = _parse(path, _read(path))
    if public is None:  # a bare key: taken as the public key it must be
        return secret  # type: ignore[return-value]
    if secret is not None:
        raise KeyFileError(f"CURVE key file {path} holds a secret key; list the public file (NAME.key) "
                           f"instead, and keep secret files on their own host")
    return public


def public_keys_from(paths: list[str]) -> dict[bytes, Path]:
    """Public keys (Z85) from files, or from every ``*.key`` file of a directory; key -> its file."""
    keys: dict[bytes, Path] = {}
    for entry in paths:
        path = Path(entry)
        if path.is_dir():
            files = sorted(path.glob("*.key"))
            if not files:
                raise KeyFileError(f"CURVE public key directory {path} has no *.key files")
        else:
            files = [path]
        for file in files:
            keys.setdefault(read_public_file(file), file)
    return keys


def _write_new(path: Path, text: str, mode: int) -> None:
    """A new key file, never through a link (``O_EXCL | O_NOFOLLOW``), ``mode`` set on what was opened."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError:
        raise KeyFileError(f"{path} exists; vpipe keys never overwrites a key file") from None
    except OSError as e:
        raise KeyFileError(f"cannot write key file {path}: {e.strerror or e}") from None
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it; never widened (on the file opened, not a name)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
    except OSError as e:  # a full disk: no half-written key file is left behind
        path.unlink(missing_ok=True)
        raise KeyFileError(f"cannot write key file {path}: {e.strerror or e}") from None


def write_keypair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600) in ZeroMQ's certificate format; a
    directory it makes is 0700 whatever the umask, and it leaves both files or neither."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name.startswith("."):
        raise ValueError(f"a key name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
    directory = Path(directory)
    try:
        check_output_dir(directory, "key directory")
        make_private_dir(directory)
    except FileCheckError as e:
        raise KeyFileError(str(e)) from None
    except OSError as e:
        raise KeyFileError(f"cannot make key directory {directory}: {e.strerror or e}") from None
    public, secret = zmq.curve_keypair()
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (secret_path, public_path):  # before either is written: a pair is written whole or not at all
        if os.path.lexists(path):
            raise KeyFileError(f"{path} exists; vpipe keys never overwrites a key file")
    head = "#   ZeroMQ CURVE {} certificate written by `vpipe keys`\n"
    _write_new(secret_path, head.format("secret") + "#   keep it on this host, mode 0600\nmetadata\ncurve\n"
               f"    public-key = \"{public.decode()}\"\n    secret-key = \"{secret.decode()}\"\n", 0o600)
    try:
        _write_new(public_path,
                   head.format("public") + "#   give it to every host of the run\nmetadata\ncurve\n"
                   f"    public-key = \"{public.decode()}\"\n", 0o644)
    # the public half failed (a full disk, a name taken since): no secret left without it
    except BaseException:
        secret_path.unlink(missing_ok=True)
        raise
    return public_path, secret_path


# ---------------------------------------------------------------- command line
def register(subparsers: Any) -> None:
    """Add ``vpipe keys`` to the CLI."""
    p = subparsers.add_parser("keys", help="write a CURVE key pair for the control plane of a multi-host run")
    p.add_argument("directory", help="where to write NAME.key (public) and NAME.key_secret (secret, 0600)")
    p.add_argument("--name", default=None, help="file name stem (default: this host's name)")
    p.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace, argv: Any = None) -> int:
    if args.name is not None and (not args.name.strip() or "/" in args.name or args.name.startswith(".")):
        raise ValueError(f"--name {args.name!r}: give a file name stem (letters, digits, - and "
                         "_), or leave --name out for this host's name")
    name = args.name or socket.gethostname().split(".")[0] or "vpipe"
    public_path, secret_path = write_keypair(args.directory, name)
    print(f"public key: {public_path} ({read_public_file(public_path).decode()})")
    print(f"secret key: {secret_path} (mode 0600; never copy it to another host)")
    print("on this host:  export VPIPE_CURVE_SECRET_FILE=" + str(secret_path.resolve()))
    print("on every host: export VPIPE_CURVE_PUBLIC_KEYS=DIR_OF_ALL_PUBLIC_KEY_FILES")
    return 0
