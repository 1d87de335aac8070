"""A GPT-style model trained by DeepSpeed's pipeline engine, the way
GPT-NeoX and Megatron-DeepSpeed build theirs.

The model is a ``PipelineModule`` of ``LayerSpec``s (an embedding, ``--layers`` transformer
blocks, a final norm and head, the loss computed on the last stage) partitioned by
DeepSpeed's ``partition_method`` and trained with ``engine.train_batch``. The first
``--heavy`` blocks run their feed-forward ``--heavy-repeat`` times: the same parameters as the
others, more compute, so a partition that counts layers or parameters leaves the first stage
the bottleneck. Run on CPU (``DS_ACCELERATOR=cpu``; the first run builds a communication op,
about two minutes)::

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 examples/train_deepspeed.py --steps 30
    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 examples/train_deepspeed.py --steps 30 --vpipe

``--vpipe`` adds the one line ``vpipe.attach(engine)`` after ``deepspeed.initialize``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, seq: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.02)
        self.position = nn.Parameter(torch.randn(seq, dim) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight) + self.position


class Block(nn.Module):
    """Pre-norm attention and MLP; ``repeat`` runs the MLP that many times (same parameters, more work)."""

    def __init__(self, dim: int, heads: int, repeat: int = 1) -> None:
        super().__init__()
        self.heads, self.repeat = heads, repeat
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, s, d))
        for _ in range(self.repeat):
            x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def tied_head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output projection through the embedding's weight (a ``TiedLayerSpec``'s forward_fn)."""
    return x @ embedding.weight.t()


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def layer_specs(args: argparse.Namespace) -> list[Any]:
    dim, vocab = args.dim, args.vocab
    blocks = [LayerSpec(Block, dim, args.heads, args.heavy_repeat if i < args.heavy else 1)
              for i in range(args.layers)]
    if args.tied:
        return [TiedLayerSpec("embed", Embedding, vocab, dim, args.seq), *blocks,
                LayerSpec(nn.LayerNorm, dim),
                TiedLayerSpec("embed", Embedding, vocab, dim, args.seq, forward_fn=tied_head)]
    return [LayerSpec(Embedding, vocab, dim, args.seq), *blocks, LayerSpec(Head, dim, vocab)]


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "torch_adam": True}},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.zero:
        config["zero_optimization"] = {"stage": args.zero}
    return config


def batches(args: argparse.Namespace, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same token batches on every rank of the pipeline (each data-parallel replica its own)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, args.vocab, (args.micro_batch_size, args.seq + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heavy", type=int, default=4, help="the first HEAVY blocks do more work")
    p.add_argument("--heavy-repeat", type=int, default=5, help="how many times a heavy block runs its MLP")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--partition", default="uniform", help="DeepSpeed's partition_method")
    p.add_argument("--checkpoint-interval", type=int, default=0, help="activation_checkpoint_interval")
    p.add_argument("--tied", action="store_true", help="tie the head to the embedding (TiedLayerSpec)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage (0 or 1)")
    p.add_argument("--vpipe", action="store_true", help="add vpipe.attach(engine)")
    p.add_argument("--out", help="write the losses and step times here as JSON (rank 0)")
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace) -> Any:
    """``deepspeed.initialize`` over the pipeline module, seeded alike on every rank."""
    torch.manual_seed(0)
    # (DeepSpeed checkpoints every layer with parameters unless told which: not the embedding, whose input
    # tokens need no gradient)
    module = PipelineModule(layers=layer_specs(args), num_stages=args.stages, loss_fn=cross_entropy,
                            partition_method=args.partition,
                            activation_checkpoint_interval=args.checkpoint_interval,
                            checkpointable_layers=["Block"] if args.checkpoint_interval else None)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()
                                                                           if p.requires_grad],
                                           config=ds_config(args))
    return engine


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    engine = build_engine(args)
    if args.vpipe:
        import vpipe

        vpipe.attach(engine)
    data = batches(args, seed=engine.grid.data_parallel_id)
    losses, times = [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        loss = engine.train_batch(data_iter=data)
        times.append(time.perf_counter() - started)
        losses.append(float(loss))
    if dist.get_rank() == 0:
        print(
            f"losses {losses[0]:.4f} -> {losses[-1]:.4f}; median step {sorted(times)[len(times) // 2]:.4f}s"
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"losses": losses, "step_s": times, "world": dist.get_world_size(),
                           "pid": os.getpid()}, f)


if __name__ == "__main__":
    main()
