"""The torch.distributed.pipelining tutorial's trainer, plus the one line that puts vpipe under it.

Run with torchrun (one stage per rank)::

    torchrun --standalone --nproc-per-node 2 examples/train_tutorial.py --steps 60
    torchrun --standalone --nproc-per-node 2 examples/train_tutorial.py --steps 60 --vpipe

The model and the split are the tutorial's (and torchtitan's): every rank builds the whole
``Transformer``, deletes the layers it does not own from ``model.layers`` (an
``nn.ModuleDict`` keyed by global layer id) and sets ``tok_embeddings`` / ``norm`` /
``output`` to ``None`` where they do not belong; ``forward`` iterates
``self.layers.values()`` and passes each block two arguments. The split here is uneven on
purpose (``--partition 6,2``): with ``--vpipe`` the planner moves blocks until the stages
take the same time, and ``forward`` never notices.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 8
    n_heads: int = 4
    vocab_size: int = 256


class Transformer(nn.Module):
    def __init__(self, model_args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        # a ModuleDict lets a stage delete layers without changing the names of the others
        self.layers = nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            # as in the tutorial (sequence-first layout); no dropout, so runs can be compared exactly
            self.layers[str(layer_id)] = nn.TransformerDecoderLayer(
                model_args.dim, model_args.n_heads, dim_feedforward=4 * model_args.dim, dropout=0.0)
        self.norm = nn.LayerNorm(model_args.dim)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # layers that are None at run time make the pipeline split easy
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, h)
        h = self.norm(h) if self.norm else h
        return self.output(h).clone() if self.output else h


def split_model(model: Transformer, stage_index: int, counts: list[int]) -> Transformer:
    """The tutorial's manual split: keep this stage's layers, drop what belongs elsewhere."""
    first = sum(counts[:stage_index])
    mine = {str(i) for i in range(first, first + counts[stage_index])}
    for name in [n for n in model.layers if n not in mine]:
        del model.layers[name]
    if stage_index != 0:
        model.tok_embeddings = None
    if stage_index != len(counts) - 1:
        model.norm = None
        model.output = None
    return model


def tokenwise_loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def batch(step: int, size: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (size, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--partition", default="6,2", help="layers per stage")
    parser.add_argument("--dim", type=int, default=int(os.environ.get("EXAMPLE_WIDTH", "64")))
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vpipe", action="store_true", help="attach vpipe (the one line below)")
    parser.add_argument("--out", default=None,
                        help="write the losses and this stage's state here (JSON + .pt)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [int(c) for c in args.partition.split(",")]
    if len(counts) != world:
        raise SystemExit(f"--partition {args.partition} names {len(counts)} stages for {world} ranks")
    model_args = ModelArgs(dim=args.dim, n_layers=sum(counts))
    torch.manual_seed(0)  # every rank builds the same full model, then keeps its part
    model = split_model(Transformer(model_args), rank, counts)
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule_class = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_class(stage, args.micro_batches, loss_fn=tokenwise_loss_fn)

    if args.vpipe:
        import vpipe

        vpipe.attach(schedule, optimizer=optimizer)  # the one line

    losses_per_step, step_s = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        x, y = batch(step, args.micro_batches * args.micro_batch_size, args.seq_len, model_args.vocab_size)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - started)
        if losses:
            losses_per_step.append([float(loss.detach()) for loss in losses])
    if args.out:
        torch.save(model.state_dict(), f"{args.out}.rank{rank}.pt")  # the user's own checkpoint code
        if rank == world - 1:
            with open(args.out, "w") as f:
                json.dump({"losses": losses_per_step, "step_s": step_s}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
