"""A Hugging Face GPT-2 split by hand into pipeline stages, plus the one line that puts vpipe under it.

Needs ``transformers`` (``pip install transformers``). Run with torchrun (one stage per rank)::

    torchrun --standalone --nproc-per-node 2 examples/train_hf_gpt2.py --steps 60
    torchrun --standalone --nproc-per-node 2 examples/train_hf_gpt2.py --steps 60 --vpipe

Each rank builds the same ``GPT2LMHeadModel`` (a small random one, nothing is downloaded)
and wraps its slice the way people do it by hand: ``nn.ModuleList(model.transformer.h[a:b])``,
the embeddings on the first stage, ``ln_f`` and ``lm_head`` on the last. vpipe finds the
``ModuleList`` of ``GPT2Block`` itself; a block that moves keeps its ``layer_idx``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from transformers import GPT2Config, GPT2LMHeadModel


class GPT2Stage(nn.Module):
    """One pipeline stage of a GPT-2: a slice of its blocks, with
    the embeddings or the head where they belong."""

    def __init__(self, model: GPT2LMHeadModel, first: int, last: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.wte = model.transformer.wte if is_first else None
        self.wpe = model.transformer.wpe if is_first else None
        self.h = nn.ModuleList(model.transformer.h[first:last])
        self.ln_f = model.transformer.ln_f if is_last else None
        self.lm_head = model.lm_head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(positions)
        for block in self.h:
            out = block(x)
            x = out[0] if isinstance(out, tuple) else out  # transformers 4 returns a tuple, 5 a tensor
        if self.ln_f is not None:
            x = self.lm_head(self.ln_f(x))
        return x


def make_model(n_layer: int, width: int, vocab: int, seq_len: int) -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=n_layer, n_embd=width, n_head=4, vocab_size=vocab, n_positions=seq_len,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(step: int, size: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (size, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--partition", default="6,2", help="blocks per stage")
    parser.add_argument("--width", type=int, default=int(os.environ.get("EXAMPLE_WIDTH", "64")))
    parser.add_argument("--vocab", type=int, default=256)
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
    model = make_model(sum(counts), args.width, args.vocab, args.seq_len)
    first = sum(counts[:rank])
    module = GPT2Stage(model, first, first + counts[rank], rank == 0, rank == world - 1)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    schedule_class = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_class(stage, args.micro_batches, loss_fn=loss_fn)

    if args.vpipe:
        import vpipe

        vpipe.attach(schedule, optimizer=optimizer)  # the one line

    losses_per_step, step_s = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        x, y = batch(step, args.micro_batches * args.micro_batch_size, args.seq_len, args.vocab)
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
        torch.save(module.state_dict(), f"{args.out}.rank{rank}.pt")
        if rank == world - 1:
            with open(args.out, "w") as f:
                json.dump({"losses": losses_per_step, "step_s": step_s,
                           "layer_idx": [block.attn.layer_idx for block in module.h]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
