"""A pipeline of tensor-parallel Llama-style blocks on a mesh, trained torchtitan's way.

Each block has separate q/k/v/o projections and a SwiGLU feed-forward; ``parallelize_module``
puts torchtitan's plan on every block over the mesh's ``tp`` dimension (ColwiseParallel on
wq/wk/wv and w1/w3, RowwiseParallel on wo and w2, the heads split across the tp ranks; no
SequenceParallel: gloo has no reduce-scatter for it), the pipeline runs over ``pp``, and
with ``dp`` in the mesh FSDP2 shards every block and the stage module over it. The
embeddings, final norm and output stay whole on their stages. Run with torchrun::

    torchrun --standalone --nproc-per-node 4 examples/train_3d.py --mesh pp,tp --steps 40
    torchrun --standalone --nproc-per-node 4 examples/train_3d.py --mesh tp,pp --steps 40 --vpipe
    torchrun --standalone --nproc-per-node 8 examples/train_3d.py --mesh pp,dp,tp --steps 10

``--vpipe`` adds the one line ``vpipe.attach(schedule, optimizer=optimizer)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 8
    n_heads: int = 4
    vocab_size: int = 256


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: a tensor-parallel rank holds n_heads / tp of them
        q, k, v = (w(x).view(bs, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.attention, self.feed_forward = Attention(args), FeedForward(args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's shape: blocks in a ModuleDict keyed by global index, parts a stage lacks set to None."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: nn.Module | None = nn.LayerNorm(args.dim)
        self.output: nn.Module | None = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(h) if self.tok_embeddings is not None else h
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def split_model(model: Transformer, stage: int, counts: list[int]) -> Transformer:
    """Keep stage ``stage``'s blocks (``counts`` per stage) and its ends, as torchtitan's splitter does."""
    first = sum(counts[:stage])
    for i in [i for i in range(sum(counts)) if not first <= i < first + counts[stage]]:
        del model.layers[str(i)]
    if stage != 0:
        model.tok_embeddings = None
    if stage != len(counts) - 1:
        model.norm = model.output = None
    return model


def parallelize(model: Transformer, mesh: DeviceMesh) -> None:
    """torchtitan's tensor-parallel plan on every block (no
    SequenceParallel), FSDP2 over dp if the mesh has it."""
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    names = mesh.mesh_dim_names or ()
    for block in model.layers.values():
        if "tp" in names:
            parallelize_module(block, mesh["tp"], plan)
    if "dp" in names:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])


def tokenwise_loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1))


def batch(step: int, replica: int, size: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + replica)
    tokens = torch.randint(0, vocab, (size, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(schedule: Any, optimizer: torch.optim.Optimizer, pp_rank: int, pp: int, x: torch.Tensor,
               y: torch.Tensor) -> list[float]:
    """One step on this pipeline rank: the first feeds the batch,
    the last the targets; its micro-batch losses."""
    losses: list[torch.Tensor] = []
    if pp_rank == 0:
        schedule.step(x)
    elif pp_rank == pp - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return [float(loss.detach()) for loss in losses]


def full_state(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole (DTensors gathered), by
    global key: comparable with a run without TP."""
    state: dict[str, torch.Tensor] = {}
    for module in modules:
        for key, value in module.state_dict().items():
            state[key] = value.full_tensor() if isinstance(value, DTensor) else value
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b")
    parser.add_argument("--mesh", default="pp,tp", help="mesh dimensions in order, of pp, tp and dp")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--partition", default=None,
                        help="blocks per stage (default 6,2; interleaved 3,3,1,1)")
    parser.add_argument("--dim", type=int, default=int(os.environ.get("EXAMPLE_WIDTH", "64")))
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vpipe", action="store_true", help="attach vpipe (the one line below)")
    parser.add_argument("--out", default=None,
                        help="write the losses and every rank's whole state here (JSON + .pt)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    names = tuple(args.mesh.split(","))
    interleaved = args.schedule == "interleaved"
    counts = [int(c) for c in (args.partition or ("3,3,1,1" if interleaved else "6,2")).split(",")]
    pp = len(counts) // 2 if interleaved else len(counts)
    sizes = {"pp": pp, "tp": args.tp, "dp": args.dp}
    if sorted(names) not in (["pp", "tp"], ["dp", "pp", "tp"], ["dp", "pp"]) or math.prod(sizes[n]
                                                                                          for n in names) \
            != world:
        raise SystemExit(f"--mesh {args.mesh} with pp={pp} tp={args.tp} dp={args.dp} does "
                         f"not cover {world} ranks")
    mesh = init_device_mesh("cpu", tuple(sizes[n] for n in names), mesh_dim_names=names)
    pp_rank, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank() if "dp" in names else 0
    model_args = ModelArgs(dim=args.dim, n_layers=sum(counts))
    indices = [pp_rank, pp_rank + pp] if interleaved else [pp_rank]
    models = []
    for index in indices:
        torch.manual_seed(0)  # every rank builds the same full model, then keeps its part
        model = split_model(Transformer(model_args), index, counts)
        parallelize(model, mesh)
        models.append(model)
    stages = [PipelineStage(m, v, len(counts), torch.device("cpu"), group=mesh.get_group("pp"))
              for m, v in zip(models, indices)]
    optimizer = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=1e-3)
    schedule = SCHEDULES[args.schedule](stages if interleaved else stages[0], args.micro_batches,
                                        loss_fn=tokenwise_loss_fn)

    if args.vpipe:
        import vpipe

        vpipe.attach(schedule, optimizer=optimizer)  # the one line

    losses_per_step, step_s = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        x, y = batch(step, replica, args.micro_batches * args.micro_batch_size, args.seq_len,
                     model_args.vocab_size)
        losses_per_step.append(train_step(schedule, optimizer, pp_rank, pp, x, y))
        step_s.append(time.perf_counter() - started)
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: {step_s[-1]:.3f} s", flush=True)
    every: list = [None] * world
    dist.all_gather_object(every, losses_per_step)
    state = full_state(models)  # collective: every rank gathers its DTensors
    if args.out:
        torch.save(state, f"{args.out}.rank{rank}.pt")
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump({"losses": every, "step_s": step_s}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
