"""Pipeline parallel inside a mesh, torchtitan's way: FSDP2 over
``dp``, the pipeline over ``pp``, plus the one line.

Run with torchrun (4 ranks: 2 pipeline stages x 2 data-parallel shards; gloo on CPU, NCCL with one GPU
per rank, which has not been run yet)::

    torchrun --standalone --nproc-per-node 4 examples/train_fsdp_pp.py
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp_pp.py --no-vpipe   # the same, without vpipe

The model is the torch pipelining tutorial's (``examples/train_tutorial.py``), split
unevenly (``--partition 6,2``). As torchtitan does, every rank builds its stage's part, then
``fully_shard``-s every block and the stage module over the mesh's ``dp`` dimension with
``reshard_after_forward=False`` (a pipeline stage runs several micro-batches' forwards before
their backwards), and FSDP reduce-scatters the gradients inside ``schedule.step``. With
vpipe attached the planner moves blocks until the stages take the same time: each dp rank
sends its own shards of a moving block (and of its Adam moments) to the rank with the same
dp coordinate on the neighbouring stage. Both replicas always hold the same blocks.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from train_tutorial import ModelArgs, Transformer, batch, split_model, tokenwise_loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--partition", default="6,2", help="layers per stage")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--no-vpipe", action="store_true", help="leave the one line out")
    args = parser.parse_args()

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    counts = [int(c) for c in args.partition.split(",")]
    world = dist.get_world_size()
    if world % len(counts):
        raise SystemExit(f"--partition {args.partition} names {len(counts)} stages; {world} ranks are not "
                         "a whole number of pipelines")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world // len(counts), len(counts)), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()

    torch.manual_seed(0)  # every rank builds the same full model, then keeps its stage's part
    model = split_model(Transformer(ModelArgs(n_layers=sum(counts))), pp, counts).to(device)
    for block in model.layers.values():  # torchtitan's apply_fsdp for pipeline stages
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    stage = PipelineStage(model, pp, len(counts), device, group=mesh.get_group("pp"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule_class = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_class(stage, args.micro_batches, loss_fn=tokenwise_loss_fn)

    vp = None
    if not args.no_vpipe:
        import vpipe

        vp = vpipe.attach(schedule, optimizer=optimizer)  # the one line

    last = pp == len(counts) - 1
    for step in range(args.steps):
        started = time.perf_counter()
        x, y = batch(step * mesh["dp"].size() + dp, args.micro_batches * args.micro_batch_size, 32, 256)
        losses: list[torch.Tensor] = []
        if pp == 0:
            schedule.step(x.to(device))
        elif last:
            schedule.step(target=y.to(device), losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if last and step % 5 == 0:
            loss = sum(float(v.detach()) for v in losses) / len(losses)
            where = f", layers per stage {[len(s) for s in vp.placement]}" if vp is not None else ""
            print(f"replica {dp} step {step}: loss {loss:.4f}, {time.perf_counter() - started:.3f} s{where}",
                  flush=True)
    if vp is not None and dist.get_rank() == 0:
        print(f"final placement: {[list(s) for s in vp.placement]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
