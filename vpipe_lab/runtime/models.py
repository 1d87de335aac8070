"""Reference models, described as a list of layer specs so any rank can build any layer.

A layer spec is a small dict of plain values (msgpack-able, so it can travel on the control
plane): ``{"kind": "block", "type": "attn", "d_model": 64, ...}``. :func:`build_layer`
turns a spec into a module whose initial weights depend only on ``(seed, layer_id)``, so a
stage builds exactly the layers it owns and a layer that migrates or is added at run time
is built identically everywhere.

Two models: a byte-level decoder-only transformer LM (embedding, N blocks, head: every
boundary carries ``(B, T, D)``) and a small CNN whose boundary shapes change from layer to
layer, so that not every test runs on equal layer shapes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vpipe_lab.runtime.data import image_batch, lm_batch

__all__ = [
    "ModelSpec",
    "transformer_lm",
    "reference_transformer",
    "cnn",
    "build_layer",
    "build_model",
    "BLOCK_TYPES",
    "register_layer_kind",
]

LayerSpec = dict[str, Any]
BLOCK_TYPES = ("attn", "ffn", "conv")


@dataclass
class ModelSpec:
    """A model as an ordered list of layer specs plus how to feed and score it."""

    name: str
    layers: list[LayerSpec]
    task: str  # "lm" or "image"
    seq_len: int = 0
    image_side: int = 16
    extra: dict[str, Any] = field(default_factory=dict)

    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lm_loss if self.task == "lm" else F.cross_entropy

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.task == "lm":
            return lm_batch(step, batch_size, self.seq_len, seed)
        return image_batch(step, batch_size, self.image_side, seed)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# ------------------------------------------------------------------ transformer LM
class Embedding(nn.Module):
    def __init__(self, vocab: int, d_model: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tok(tokens) + self.pos[: tokens.shape[1]])


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.scale = 1.0 / math.sqrt(d_model // n_heads)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * self.scale
        future = torch.ones_like(att, dtype=torch.bool).triu(1)
        att = self.drop(att.masked_fill(future, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.out = nn.Linear(d_ff, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(F.gelu(self.fc(x))))


class CausalConv(nn.Module):
    """Depthwise causal convolution over the sequence (an 'evolved transformer'-style cell)."""

    def __init__(self, d_model: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv1d(d_model, d_model, kernel, groups=d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pad(x.transpose(1, 2), (self.kernel - 1, 0))
        return self.conv(y).transpose(1, 2)


class Block(nn.Module):
    """Pre-norm residual block; ``type`` picks the mixer: attention, none, or convolution."""

    def __init__(self, type: str, d_model: int, n_heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        if type not in BLOCK_TYPES:
            raise ValueError(f"unknown block type {type!r}; known: {', '.join(BLOCK_TYPES)}")
        self.block_type = type  # not self.type: that would shadow nn.Module.type(dst_type)
        self.ln1 = nn.LayerNorm(d_model)
        if type == "attn":
            self.mix: nn.Module = CausalSelfAttention(d_model, n_heads, dropout)
        elif type == "conv":
            self.mix = CausalConv(d_model, kernel=3)
        else:
            self.mix = nn.Identity()
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, d_ff, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_type != "ffn":
            x = x + self.mix(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def transformer_lm(
    n_blocks: int = 8,
    d_model: int = 64,
    n_heads: int = 4,
    d_ff: int | None = None,
    seq_len: int = 64,
    dropout: float = 0.1,
    vocab: int = 256,
    block_types: list[str] | None = None,
) -> ModelSpec:
    """Embedding, ``n_blocks`` blocks (all ``attn`` unless ``block_types`` says otherwise), head."""
    d_ff = d_ff or 4 * d_model
    types = block_types or ["attn"] * n_blocks
    if len(types) != n_blocks:
        raise ValueError(f"block_types has {len(types)} entries for {n_blocks} blocks")
    common = {"d_model": d_model, "dropout": dropout}
    layers: list[LayerSpec] = [{"kind": "embed", "vocab": vocab, "seq_len": seq_len, **common}]
    layers += [block_spec(t, d_model, n_heads, d_ff, dropout) for t in types]
    layers.append({"kind": "head", "d_model": d_model, "vocab": vocab})
    return ModelSpec(name=f"transformer-{n_blocks}x{d_model}", layers=layers, task="lm", seq_len=seq_len)


def block_spec(type: str, d_model: int, n_heads: int, d_ff: int, dropout: float) -> LayerSpec:
    return {"kind": "block", "type": type, "d_model": d_model, "n_heads": n_heads, "d_ff": d_ff,
            "dropout": dropout}


# ------------------------------------------------------------------ CNN
class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1)
        self.norm = nn.GroupNorm(4, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class ConvHead(nn.Module):
    def __init__(self, c_in: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def cnn(widths: tuple[int, ...] = (16, 16, 32, 32, 64, 64), classes: int = 256, side: int = 16) -> ModelSpec:
    """A stem and conv blocks that halve the resolution whenever the width grows, then a head."""
    layers: list[LayerSpec] = [{"kind": "conv", "c_in": 1, "c_out": widths[0], "stride": 1}]
    for c_in, c_out in zip(widths, widths[1:]):
        layers.append({"kind": "conv", "c_in": c_in, "c_out": c_out, "stride": 2 if c_out > c_in else 1})
    layers.append({"kind": "conv_head", "c_in": widths[-1], "classes": classes})
    return ModelSpec(name=f"cnn-{len(widths)}", layers=layers, task="image", image_side=side)


# ------------------------------------------------------------------ building
_BUILDERS: dict[str, Callable[[LayerSpec], nn.Module]] = {
    "embed": lambda s: Embedding(s["vocab"], s["d_model"], s["seq_len"], s["dropout"]),
    "block": lambda s: Block(s["type"], s["d_model"], s["n_heads"], s["d_ff"], s["dropout"]),
    "head": lambda s: Head(s["d_model"], s["vocab"]),
    "conv": lambda s: ConvBlock(s["c_in"], s["c_out"], s["stride"]),
    "conv_head": lambda s: ConvHead(s["c_in"], s["classes"]),
}


def register_layer_kind(kind: str, builder: Callable[[LayerSpec], nn.Module]) -> None:
    """Teach :func:`build_layer` a new layer kind (for models other than the reference ones)."""
    _BUILDERS[kind] = builder


def build_layer(spec: LayerSpec, layer_id: int, seed: int = 0) -> nn.Module:
    """Build one layer; its initial weights depend only on ``(seed, layer_id)``."""
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ValueError(f"a layer spec must be a dict with a 'kind', got {spec!r}")
    builder = _BUILDERS.get(spec["kind"])
    if builder is None:
        raise ValueError(f"unknown layer kind {spec['kind']!r}; known: {', '.join(sorted(_BUILDERS))}")
    try:
        if torch.empty(()).is_meta:  # only shapes are wanted (a migration target): no values, no RNG to fork
            return builder(spec)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + layer_id)
            return builder(spec)
    except KeyError as e:
        raise ValueError(f"layer spec {spec!r} is missing the key {e.args[0]!r}") from None


def build_model(spec: ModelSpec, seed: int = 0, ids: list[int] | None = None) -> nn.Sequential:
    """The whole model as an ``nn.Sequential`` whose children are named by layer id."""
    ids = list(range(len(spec.layers))) if ids is None else ids
    return nn.Sequential(OrderedDict((str(i), build_layer(s, i, seed)) for i, s in zip(ids, spec.layers)))


def reference_transformer(blocks: int = 8, d_model: int = 64, seq_len: int = 64,
                          dropout: float = 0.1) -> nn.Sequential:
    """The reference transformer LM as one module, for ``vpipe plan --model``: its input is a
    micro-batch of token ids, shape ``(batch, seq_len)``, dtype int64."""
    return build_model(transformer_lm(n_blocks=blocks, d_model=d_model, seq_len=seq_len, dropout=dropout))
