"""Rank program for tests/integration/test_deepspeed.py: DeepSpeed's pipeline engine with and without vpipe.

The model and engine are examples/train_deepspeed.py's (an embedding, 8 blocks, the first four
heavier, a head; DeepSpeed's uniform partition puts layers 0-4 on stage 0 and 5-9 on stage 1).
In one launch each scenario trains a plain DeepSpeed engine and an engine with the one line
``vpipe.attach(engine)``, built alike, on the same batches. Scenarios (``argv[1]``):

- ``moves``: planning off, forced moves (blocks 3 and 4 to stage 1 before step 2, blocks 3-5 to stage 0
  before step 4), a ``save_checkpoint`` after step 5; then a third, plain engine loads that checkpoint
  and trains the last steps. Rank 0 writes the three loss lists and what was saved;
- ``policies``: blocks 1 swapped and 2 recomputed (min_swap_bytes=0) and a forced move;
- ``checkpointing``: ``activation_checkpoint_interval=1``: DeepSpeed recomputes, vpipe only moves;
- ``tied``: the head tied to the embedding (``TiedLayerSpec``), a forced move;
- ``bf16`` and ``zero1`` (4 ranks: 2 replicas): moves refused in one
  line, a forced plan applies policies only;
- ``replicas`` (4 ranks): 2 data-parallel replicas without ZeRO, a forced move made by both alike;
- ``model_parallel`` (4 ranks): a grid with a model axis: moves refused in one line;
- ``shapes``: block 4 halves the sequence; forced moves carry it to stage 1 and back, each changing the
  activation stage 0 sends (the engine's cached shapes and p2p buffers must follow).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")
_spec = importlib.util.spec_from_file_location("train_deepspeed",
                                               Path(__file__).parents[2] / "examples" / "train_deepspeed.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)  # type: ignore[union-attr]

STEPS = 8


def train(engine: Any, steps: int, skip_steps: int = 0, vp: Any = None) -> tuple[list[float], list]:
    """``steps`` train_batch calls on the example's batches (after skipping ``skip_steps`` steps' worth); each
    data-parallel replica its own."""
    data = example.batches(engine.args_for_test, engine.grid.data_parallel_id)
    for _ in range(skip_steps * engine.micro_batches):
        next(data)
    losses, placements = [], []
    for _ in range(steps):
        losses.append(float(engine.train_batch(data_iter=data)))
        placements.append([list(s) for s in vp.placement] if vp is not None else None)
    return losses, placements


def engine_for(args: Any) -> Any:
    engine = example.build_engine(args)
    engine.args_for_test = args
    return engine


def side_by_side(argv: list[str], *, forced: list[tuple[int, Any]], steps: int = STEPS,
                 **options: Any) -> dict:
    import vpipe

    args = example.parse_args(argv)
    plain_engine = engine_for(args)
    plain, _ = train(plain_engine, steps)
    engine = engine_for(args)
    vp = vpipe.attach(engine, **{"planning": False, **options})
    for at, plan in forced:
        vp.request_plan(plan, at_step=at)
    losses, placements = train(engine, steps, vp=vp)
    summary = vp.tensor_manager.summary() if vp.tensor_manager is not None else None
    vp.detach()
    return {"plain": plain, "vpipe": losses, "placements": placements, "moves_off": vp.move_refusal,
            "tensor_manager": summary is not None, "d2h_bytes": summary["d2h_bytes"] if summary else 0,
            "recompute_s": summary["recompute_s"] if summary else 0.0, "forward_funcs": _funcs(engine),
            "layers": {"plain": _digests(plain_engine), "vpipe": _digests(engine)}}


def _digests(engine: Any) -> dict:
    """Every layer's parameters (by global index, from the stage that holds it) as one digest per tensor,
    merged over the ranks of the first replica."""
    start = engine.module.parts[engine.stage_id]
    mine = {}
    for position, layer in enumerate(engine.module.forward_funcs):
        if isinstance(layer, torch.nn.Module):
            for name, p in layer.state_dict().items():
                data = p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # bf16 too
                mine[f"{start + position}.{name}"] = hashlib.sha256(data).hexdigest()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def _funcs(engine: Any) -> dict:
    """This stage's layers as DeepSpeed now runs and names them, from every rank."""
    mine = {"stage": engine.stage_id, "parts": list(engine.module.parts),
            "registered": [k for k, _ in engine.module.named_children() if k.isdigit()],
            "funcs": [type(f).__name__ for f in engine.module.forward_funcs],
            "fwd_map": dict(engine.module.fwd_map)}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"stages": every}


def moves(out_dir: Path) -> dict:
    import vpipe

    args = example.parse_args([])
    plain_engine = engine_for(args)
    plain, _ = train(plain_engine, STEPS)
    engine = engine_for(args)
    try:
        vpipe.attach(engine.module)
        module_refused = None
    except TypeError as e:
        module_refused = str(e)
    vp = vpipe.attach(engine, planning=False)
    try:
        vp.remove_layers([3])
        refused = None
    except RuntimeError as e:
        refused = str(e)
    vp.request_plan(vpipe.Plan(epoch=1, stages=((1, 2), (3, 4, 5, 6, 7, 8))), at_step=2)
    vp.request_plan(vpipe.Plan(epoch=2, stages=((1, 2, 3, 4, 5), (6, 7, 8))), at_step=4)
    data = example.batches(args, 0)
    losses, placements = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(data_iter=data)))
        placements.append([list(s) for s in vp.placement])
        if step == 5:
            engine.save_checkpoint(str(out_dir / "ckpt"), tag="step6")
            placements.append([list(s) for s in vp.placement])  # back where the plan put them
    funcs = _funcs(engine)
    layers = _digests(engine)
    vp.detach()
    resumed_engine = engine_for(args)  # DeepSpeed alone, on its own partition
    resumed_engine.load_checkpoint(str(out_dir / "ckpt"), tag="step6")
    resumed, _ = train(resumed_engine, STEPS - 6, skip_steps=6)
    files = sorted(p.name for p in (out_dir / "ckpt" / "step6").iterdir())
    return {"plain": plain, "vpipe": losses, "resumed": resumed, "placements": placements, "files": files,
            "edit_refused": refused, "module_refused": module_refused,
            "forward_funcs": funcs, "layers": {"plain": _digests(plain_engine), "vpipe": layers,
                                                    "resumed": _digests(resumed_engine)}}


def policies(_: Path) -> dict:
    import vpipe

    return side_by_side([], forced=[(3, vpipe.Plan(epoch=1, stages=((1, 2, 3), (4, 5, 6, 7, 8)),
                                                   policies={1: vpipe.Policy.SWAP,
                                                             2: vpipe.Policy.RECOMPUTE}))],
                        policies={1: "S", 2: "R"}, min_swap_bytes=0)


def _moved(argv: list[str]) -> dict:
    import vpipe

    return side_by_side(argv, forced=[(2, vpipe.Plan(epoch=1, stages=((1, 2, 3), (4, 5, 6, 7, 8))))])


class StridingBlock(example.Block):
    """The example's block that keeps every ``stride``-th position of its output (a plain attribute: a
    clone of one of its kind takes the moved block's)."""

    def __init__(self, dim: int, heads: int, stride: int = 1) -> None:
        super().__init__(dim, heads)
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[:, ::self.stride].contiguous()  # (DeepSpeed sends it as it is)


def strided_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return example.cross_entropy(logits, labels[:, ::2])


def shapes(_: Path) -> dict:
    """Block 4, the last of stage 0, halves the sequence: moving it to stage 1 doubles what stage 0 sends."""
    import vpipe

    args = example.parse_args([])
    layers = [example.LayerSpec(example.Embedding, args.vocab, args.dim, args.seq),
              *[example.LayerSpec(StridingBlock, args.dim, args.heads, 2 if i == 4 else 1)
                for i in range(1, 9)],
              example.LayerSpec(example.Head, args.dim, args.vocab)]

    def build() -> Any:
        torch.manual_seed(0)
        module = example.PipelineModule(layers=layers, num_stages=2, loss_fn=strided_loss)
        engine, _, _, _ = example.deepspeed.initialize(model=module,
                                                       model_parameters=list(module.parameters()),
                                                       config=example.ds_config(args))
        engine.args_for_test = args
        return engine

    plain, _ = train(build(), STEPS)
    engine = build()
    vp = vpipe.attach(engine, planning=False)
    vp.request_plan(vpipe.Plan(epoch=1, stages=((1, 2, 3), (4, 5, 6, 7, 8))), at_step=2)
    vp.request_plan(vpipe.Plan(epoch=2, stages=((1, 2, 3, 4, 5), (6, 7, 8))), at_step=4)
    losses, placements = train(engine, STEPS, vp=vp)
    vp.detach()
    return {"plain": plain, "vpipe": losses, "placements": placements}


def model_parallel(_: Path) -> dict:
    """A grid with a model axis (Megatron-DeepSpeed's tensor
    parallelism): 2 stages x 2 model-parallel ranks."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    import vpipe

    args = example.parse_args([])
    torch.manual_seed(0)
    module = example.PipelineModule(layers=example.layer_specs(args), loss_fn=example.cross_entropy,
                                    topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
    engine, _, _, _ = example.deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                                   config=example.ds_config(args))
    vp = vpipe.attach(engine)
    refusal = vp.move_refusal
    vp.detach()
    return {"moves_off": refusal}


SCENARIOS = {
    "model_parallel": model_parallel, "shapes": shapes,
    "moves": moves, "policies": policies,
    "checkpointing": lambda _: _moved(["--checkpoint-interval", "1"]),
    "tied": lambda _: _moved(["--tied"]),
    "bf16": lambda _: _moved(["--bf16"]),
    "zero1": lambda _: _moved(["--zero", "1"]),
    "replicas": lambda _: _moved([]),
}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    example.deepspeed.init_distributed(dist_backend="gloo")
    result = SCENARIOS[scenario](out.parent)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
