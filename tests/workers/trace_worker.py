"""Rank program for tests/integration/test_timeline.py: the torch pipelining tutorial's
trainer on a 6,2 split, what rank 0 saw as JSON. Scenarios:

- ``timeline``: a trace window of steps 2-4 into DIR, then one step under torch.profiler;
- ``metrics``: per-step metrics to TensorBoard in DIR, the monitor sampling every 3rd step.

    trace_worker.py OUT.json DIR [timeline|metrics]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from shape_worker import tut  # the tutorial example's model, loaded from examples/
from torch.distributed.pipelining import PipelineStage, Schedule1F1B


def main() -> None:
    out, trace_dir = sys.argv[1], sys.argv[2]
    scenario = sys.argv[3] if len(sys.argv) > 3 else "timeline"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import vpipe

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model_args = tut.ModelArgs(dim=96)
    model = tut.split_model(tut.Transformer(model_args), rank, [6, 2])
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = Schedule1F1B(stage, 4, loss_fn=tut.tokenwise_loss_fn)
    if scenario == "metrics":
        vp = vpipe.attach(schedule, optimizer=optimizer, metrics="tensorboard", metrics_dir=trace_dir,
                          sample_every=3,
                          max_sample_every=3, policies={1: "R"})
    # the one line, with the timeline of steps 2, 3 and 4; block 1 recomputed: vpipe has work of its own
    else:
        vp = vpipe.attach(schedule, optimizer=optimizer, trace_steps=(2, 3), trace_dir=trace_dir,
                          policies={1: "R"})

    def train_step(step: int) -> None:
        x, y = tut.batch(step, 8, 32, model_args.vocab_size)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for step in range(7):
        train_step(step)
    if scenario == "metrics":
        vp.detach()  # flushes and closes the writers
        if rank == 0:
            Path(out).write_text(json.dumps({"steps": 7}))
        dist.barrier()
        dist.destroy_process_group()
        return
    written = [p.name for p in sorted(Path(trace_dir).glob("timeline-rank*.json"))]  # after the window
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train_step(7)
    names = sorted({e.name for e in prof.events() if e.name.startswith("vpipe.")})
    vp.detach()
    if rank == 0:
        Path(out).write_text(json.dumps({"written_after_window": written, "profiler_ranges": names}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
