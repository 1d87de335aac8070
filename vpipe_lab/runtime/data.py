"""Training data that every machine has without a download: the Python standard library.

The corpus is the bytes of the standard library's top-level ``*.py`` files in name order,
so it is identical for every rank of a run (ranks never exchange data: stage 0 and the
last stage each derive the batch they need from the step number and the seed).
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch

__all__ = ["stdlib_corpus", "lm_batch", "image_batch"]


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 2_000_000) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the stdlib's source as a uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < 10_000:
        raise RuntimeError(f"the standard library under {root} is too small to train on ({len(blob)} bytes)")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _offsets(step: int, batch_size: int, span: int, seed: int, corpus_len: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, corpus_len - span - 1, (batch_size,), generator=gen)


def lm_batch(step: int, batch_size: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte-level next-token batch: inputs ``(B, T)`` and targets shifted by one (int64)."""
    corpus = stdlib_corpus()
    starts = _offsets(step, batch_size, seq_len, seed, len(corpus))
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    window = corpus[idx].long()
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def image_batch(step: int, batch_size: int, side: int = 16, seed: int = 0) -> tuple[torch.Tensor,
                                                                                    torch.Tensor]:
    """Windows of ``side*side`` bytes as 1-channel images; the label is the byte that follows."""
    corpus = stdlib_corpus()
    span = side * side
    starts = _offsets(step, batch_size, span, seed, len(corpus))
    idx = starts[:, None] + torch.arange(span + 1)[None, :]
    window = corpus[idx].float()
    images = (window[:, :span] / 127.5 - 1.0).reshape(batch_size, 1, side, side)
    return images.contiguous(), window[:, span].long()
