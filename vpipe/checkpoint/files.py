"""Checkpoint files a crash or a damaged disk cannot pass off as whole: atomic writes, verified reads.

A file is written to a temporary name, fsynced and renamed, so a crash leaves either the
old file or the whole new one. A file is judged by ``stat`` before a byte of it is read
(a FIFO would block a read forever, a padded file would be read whole), and a shard's
bytes are hashed in chunks against the sha256 its manifest records.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from vpipe.checkpoint.layout import CheckpointError, ShardInfo

__all__ = ["atomic_write", "check_file", "verify_shard", "read_verified"]

_CHUNK = 4 << 20


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C: the partial file goes, the previous checkpoint stays whole
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


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
        raise CheckpointError(f"{what} {path} is truncated or padded: {info.st_size} bytes, the manifest says {size}")
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
