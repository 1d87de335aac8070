"""Checkpoint files a crash or a damaged disk cannot pass off as whole: atomic writes, verified reads.

A file is written to a new temporary file (never through a link), fsynced and renamed, so a crash
leaves either the old file or the whole new one. A file is judged by ``stat`` before a byte of it is
read (a FIFO would block a read forever, a padded file would be read whole), and a shard's bytes are
hashed in chunks against the sha256 its manifest records.
"""

from __future__ import annotations

import errno
import hashlib
import stat
from pathlib import Path

from vpipe.checkpoint.layout import CheckpointError, ShardInfo
from vpipe.files import make_dirs, write_atomic

__all__ = ["atomic_write", "make_step_dir", "check_file", "verify_shard", "read_verified"]

_CHUNK = 4 << 20


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the whole new one: a new
    temporary (``0600``, never through a link planted in a shared checkpoint directory), fsynced, renamed,
    and the directory fsynced (:func:`vpipe.files.write_atomic`)."""
    write_atomic(path, data, fsync=True, what="checkpoint")


def make_step_dir(path: Path) -> None:
    """The checkpoint's directory, made ``0700`` (with its parents) if missing: a real
    directory, never a link (one planted in a shared checkpoint directory, or on the way to
    it, would take the shards and the manifest elsewhere)."""
    if path.is_symlink():
        raise OSError(errno.ELOOP, f"{path} is a symbolic link, not a checkpoint directory vpipe made")
    make_dirs(path, "checkpoint directory")


def check_file(path: Path, what: str, size: int | None = None, limit: int | None = None) -> None:
    """A regular file of the expected size, judged by ``stat`` before a byte is read (a FIFO would block
    a read forever, a padded file would be read whole)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {what} {path}: {e.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{what} {path} is not a regular file")
    if size is not None and info.st_size != size:
        raise CheckpointError(f"{what} {path} is truncated or padded: {info.st_size} bytes, the "
                              f"manifest says {size}")
    if limit is not None and info.st_size > limit:
        raise CheckpointError(f"{what} {path} has {info.st_size} bytes, more than a manifest can ({limit})")


def verify_shard(path: Path, shard: ShardInfo, keep: bool) -> bytes | None:
    """Check a shard's type, size and sha256, reading it once in chunks; its bytes when ``keep``."""
    check_file(path, "checkpoint shard", size=shard.bytes)
    digest, chunks = hashlib.sha256(), []
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                if keep:
                    chunks.append(chunk)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint shard {path}: {e.strerror}") from None
    if digest.hexdigest() != shard.sha256:
        raise CheckpointError(f"checkpoint shard {path} is corrupted: sha256 {digest.hexdigest()[:16]}..., "
                              f"the manifest says {shard.sha256[:16]}...")
    return b"".join(chunks) if keep else None


def read_verified(path: Path, shard: ShardInfo) -> bytes:
    data = verify_shard(path, shard, keep=True)
    assert data is not None
    return data
