"""The fuzzer's models: block kinds, the four stage shapes, and cutting one stage out of a whole model.

Every block carries ``layer_id`` (a plain attribute, which travels with a moved block), so a
block's global id is read off the block itself wherever it runs: the comparison names every
tensor by it, on both copies, whatever the split.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fuzz.draws import PIPEDREAM, Draw, block_kind

DIM, HIDDEN, VOCAB, SEQ, EXPERTS, RANK = 16, 32, 32, 4, 2, 4


def _autocast(on: bool) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


class DenseBlock(nn.Module):
    """A pre-norm residual MLP block (torchtitan's feed-forward, without attention)."""

    def __init__(self, layer_id: int, bf16: bool) -> None:
        super().__init__()
        self.layer_id, self.bf16 = layer_id, bf16
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, HIDDEN)
        self.proj = nn.Linear(HIDDEN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with _autocast(self.bf16):
            out = self.proj(torch.tanh(self.fc(self.norm(h))))
        return h + out.to(h.dtype)


class NormBlock(nn.Module):
    """BatchNorm (float running stats, int64 ``num_batches_tracked``) and the buffers users keep: an int64
    call counter the forward bumps, a float64 running scale (after tests/workers/block_worker.py)."""

    def __init__(self, layer_id: int, bf16: bool, scalar_gain: bool = True) -> None:
        super().__init__()
        self.layer_id, self.bf16 = layer_id, bf16
        self.fc = nn.Linear(DIM, DIM)
        # fully_shard cannot shard a 0-d one
        self.gain = nn.Parameter(torch.ones(() if scalar_gain else (1,)))
        self.bn = nn.BatchNorm1d(DIM)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.ones(DIM, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, DIM)
        if self.training:
            with torch.no_grad():
                self.calls += 1
                self.scale.mul_(0.9).add_(flat.detach().double().abs().mean(0), alpha=0.1)
        with _autocast(self.bf16):
            out = self.bn(self.fc(flat) * self.gain)
        return h + (torch.relu(out).to(h.dtype) * self.scale.to(h.dtype)).reshape(h.shape)


class LoraBlock(nn.Module):
    """LoRA-like: a frozen base projection, trainable low-rank
    factors and norm (the optimizer sees only those)."""

    def __init__(self, layer_id: int, bf16: bool) -> None:
        super().__init__()
        self.layer_id, self.bf16 = layer_id, bf16
        self.norm = nn.LayerNorm(DIM)
        self.base = nn.Linear(DIM, DIM)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(RANK, DIM) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(DIM, RANK) * 0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with _autocast(self.bf16):
            x = self.norm(h)
            out = self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()
        return h + torch.tanh(out).to(h.dtype)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(h)))


class MoEBlock(nn.Module):
    """A small mixture of experts: a router, an ``experts`` ModuleList, top-1 routing
    and an int64 buffer counting the tokens each expert got (every expert runs on
    every token, so the result does not depend on routing)."""

    def __init__(self, layer_id: int, bf16: bool) -> None:
        super().__init__()
        self.layer_id, self.bf16 = layer_id, bf16
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS, dtype=torch.int64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # autocast caches its cast of a leaf that requires grad, and a stage's received input
        # is one: a block first on its stage would sum its input's gradient from router and
        # experts in bf16, elsewhere in fp32 (torch's arithmetic depending on the split, found
        # by this fuzzer): the block casts its input once itself
        x = h.to(torch.bfloat16) if self.bf16 else h
        with _autocast(self.bf16):
            gate = torch.softmax(self.router(x).float(), dim=-1)
            choice = gate.argmax(dim=-1)
            if self.training:
                with torch.no_grad():
                    self.tokens_per_expert += torch.bincount(choice.flatten(), minlength=EXPERTS)
            weight = F.one_hot(choice, EXPERTS).to(gate.dtype) * gate
            out = sum(weight[..., e:e + 1] * expert(x).float() for e, expert in enumerate(self.experts))
        return h + out.to(h.dtype)


DENSE_KINDS = {"plain": DenseBlock, "tied": DenseBlock, "hook": DenseBlock, "batchnorm": NormBlock,
               "frozen": LoraBlock}


def make_block(d: Draw, layer_id: int) -> nn.Module:
    bf16 = d.autocast == "bf16"
    if block_kind(d.shape, layer_id) == "moe":
        block: nn.Module = MoEBlock(layer_id, bf16)
        if d.block_state == "frozen":
            block.router.requires_grad_(False)
        return block
    if d.block_state == "batchnorm":
        # fully_shard cannot shard a 0-d parameter, nor DeepSpeed's initialize broadcast one (as bytes)
        return NormBlock(layer_id, bf16, scalar_gain=not d.fsdp and d.engine == "torch")
    return DENSE_KINDS[d.block_state](layer_id, bf16)


def _weights(d: Draw, block: nn.Module) -> nn.Module:
    """``weights=parametrized``: the block's first Linear under torch's weight_norm."""
    if d.weights == "parametrized" and isinstance(getattr(block, "fc", None), nn.Linear):
        torch.nn.utils.parametrizations.weight_norm(block.fc)
    return block


def new_block(d: Draw, layer_id: int) -> nn.Module:
    """The block ``nas=add`` inserts (and the layer factory vpipe's copy is given): seeded by its id, so
    both copies build the same one, without touching the global random state the trainers draw from."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(10_000 * d.seed + layer_id)
        from fuzz.recipes import compile_block

        return compile_block(d.compiled, _weights(d, make_block(d, layer_id)))


def insert_block(d: Draw, module: nn.Module, at: int, block: nn.Module) -> None:
    """Put ``block`` at local position ``at`` of ``module``'s container, as vpipe does (keyed by its global
    id in a ModuleDict; the positional containers renumber)."""
    blocks = container(d, module)
    if isinstance(blocks, nn.ModuleDict):
        items = list(blocks.items())
        items.insert(at, (str(block.layer_id), block))
        blocks.clear()
        blocks.update(items)
    else:
        blocks.insert(at, block)


class IdStage(nn.Module):
    """The torch pipelining tutorial's / torchtitan's shape: ``layers`` a ModuleDict
    keyed by global id, an input projection on the first stage and a head on the
    last, None elsewhere (``moduledict`` and ``mixed``)."""

    def __init__(self, blocks: list[nn.Module], first: dict[str, nn.Module],
                 last: dict[str, nn.Module]) -> None:
        super().__init__()
        self.inp: nn.Module | None = first.get("inp")
        self.layers = nn.ModuleDict({str(b.layer_id): b for b in blocks})
        self.out: nn.Module | None = last.get("out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) if self.inp is not None else x
        for block in self.layers.values():
            h = block(h)
        return self.out(h) if self.out is not None else h


class HFStage(nn.Module):
    """Hugging Face's shape: token embeddings on the first stage, ``self.h`` a ModuleList of this stage's
    blocks, ``ln_f`` and the LM head on the last."""

    def __init__(self, blocks: list[nn.Module], first: dict[str, nn.Module],
                 last: dict[str, nn.Module]) -> None:
        super().__init__()
        self.wte: nn.Module | None = first.get("wte")
        self.h = nn.ModuleList(blocks)
        self.ln_f: nn.Module | None = last.get("ln_f")
        self.head: nn.Module | None = last.get("head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) if self.wte is not None else x
        for block in self.h:
            h = block(h)
        if self.ln_f is not None and self.head is not None:
            h = self.head(self.ln_f(h))
        return h


def whole_model(d: Draw) -> tuple[dict[str, nn.Module], list[nn.Module], dict[str, nn.Module]]:
    """The whole model's parts (first-stage modules, blocks, last-stage modules), seeded by the draw."""
    torch.manual_seed(d.seed)
    first: dict[str, nn.Module] = {}
    last: dict[str, nn.Module] = {}
    if d.shape in ("moduledict", "mixed"):
        first["inp"] = nn.Linear(DIM, DIM)
    elif d.shape == "modulelist":
        first["wte"] = nn.Embedding(VOCAB, DIM)
    blocks = [_weights(d, make_block(d, i)) for i in range(d.layers)]
    if d.shape in ("moduledict", "mixed"):
        last["out"] = nn.Linear(DIM, DIM)
    elif d.shape == "modulelist":
        last["ln_f"], last["head"] = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)
    if d.block_state == "tied":
        a, b = d.pinned
        blocks[b].proj = blocks[a].proj  # weight sharing across layers: both blocks are pinned to their stage
    return first, blocks, last


def stage_module(d: Draw, parts: tuple[dict[str, nn.Module], list[nn.Module], dict[str, nn.Module]],
                 stage: int) -> nn.Module:
    """Stage ``stage`` of the first split, a deep copy (each copy of the trainer gets its own tensors)."""
    first, blocks, last = parts
    ids = d.stage_blocks()[stage]
    mine = [blocks[i] for i in ids]
    f = first if stage == 0 else {}
    la = last if stage == d.num_stages - 1 else {}
    # what vpipe's PipeDream streams move: keyed by id
    if d.shape == "sequential" and d.schedule in PIPEDREAM:
        module: nn.Module = nn.Sequential(OrderedDict((str(b.layer_id), b) for b in mine))
    elif d.shape == "sequential":
        module = nn.Sequential(*mine)  # children named 0..n-1 on every stage
    elif d.shape == "modulelist":
        module = HFStage(mine, f, la)
    else:
        module = IdStage(mine, f, la)
    return copy.deepcopy(module)


def container(d: Draw, module: nn.Module) -> nn.Module:
    """The stage's block container."""
    if d.shape == "sequential":
        return module
    return module.h if d.shape == "modulelist" else module.layers


class CountingHook:
    """A stateful forward hook: counts its block's calls and lets the count shift the output."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return output + 1e-3 * self.calls


def add_hooks(d: Draw, module: nn.Module) -> None:
    if d.block_state != "hook":
        return
    for block in container(d, module).children():
        if block.layer_id in d.pinned:
            block.register_forward_hook(CountingHook())


def batch(d: Draw, step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of ``step`` (each data-parallel replica its own)."""
    gen = torch.Generator().manual_seed(d.seed * 1000 + step * 10 + replica)
    rows = 2 * d.micro_batches
    if d.shape == "modulelist":
        return (torch.randint(VOCAB, (rows, SEQ), generator=gen),
                torch.randint(VOCAB, (rows, SEQ), generator=gen))
    return torch.randn(rows, DIM, generator=gen), torch.randn(rows, DIM, generator=gen)


def loss_fn(d: Draw) -> Any:
    """The loss, scaled by the accumulation window as users scale it."""
    if d.shape == "modulelist":
        return lambda out, target: F.cross_entropy(out.flatten(0, 1).float(), target.flatten()) / d.accum
    return lambda out, target: F.mse_loss(out.float(), target) / d.accum
