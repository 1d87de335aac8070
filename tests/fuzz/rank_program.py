"""Rank program of the fuzzer: many draws in one job of ranks, each trained twice side by side.

``rank_program.py --out OUT --logs DIR --seeds 3,4,5 [--fsdp-every 10] [--draw-timeout S]
[--mixed-autodetect]``, launched on 2 ranks (or 4 for FSDP2 draws) by ``tests/fuzz/run.py`` as
``support.processes`` launches the workers. For each seed, in the same processes: build the draw's
trainer twice (a plain copy and a copy with ``vpipe.attach``) on process groups made for the draw,
train both on the same batches while vpipe's copy is told to move blocks, compare, detach, clean up.
Rank 0 appends a ``start`` line before a draw and one result line after it to OUT (JSON lines). A
draw that raises on any rank is an ERROR on every rank (a flag all-reduced over the fuzzer's own
group), and the job goes on; a draw that hangs ends the job after ``--draw-timeout`` with every
thread's stack (faulthandler), and ``run.py`` starts the rest again.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import itertools
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

# tests/: ``fuzz`` importable when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuzz.compare import fingerprint, snapshot  # noqa: E402
from fuzz.draws import FSDP_EVERY, Draw, draw, override  # noqa: E402
from fuzz.judge import judge  # noqa: E402
from fuzz.models import container, new_block, whole_model  # noqa: E402
from fuzz.recipes import forget_compiled  # noqa: E402
from fuzz.trainer import Copy, add_block, build, finish, remove_block, train_step  # noqa: E402

GROUP_TIMEOUT_S = 30  # a rank left waiting on a peer that failed gives up after this, then the job goes on


class DrawState:
    """What one draw made that must go when it ends: process groups, vpipe, where it got to."""

    def __init__(self) -> None:
        self.groups: list[Any] = []
        self.kept: list[Any] = []
        self.vp: Any = None
        self.phase = "build"

    def group(self) -> Any:
        g = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        self.groups.append(g)
        return g

    def cleanup(self) -> None:
        if self.vp is not None:
            try:
                self.vp.detach()
            except Exception:  # noqa: BLE001 - the draw has failed already; its groups go below all the same
                pass
            channel = getattr(getattr(self.vp, "layer_manager", None), "channel", None)
            if channel is not None:  # vpipe's transfer group: attach makes one, detach leaves it
                self.groups.append(channel.group)
        for g in self.groups:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - a group already gone
                pass
        self.groups.clear()
        self.vp = None
        forget_compiled()


def _mesh(d: Draw, st: DrawState) -> Any:
    """A 2x2 mesh in the draw's dimension order, from groups made here (init_device_mesh's groups wait 30
    min on a peer that failed: these give up after GROUP_TIMEOUT_S)."""
    from torch.distributed.device_mesh import DeviceMesh

    order = tuple(d.mesh.split("_"))  # ("dp", "pp"), ("pp", "tp"), ...
    side = "tp" if "tp" in order else "dp"  # the dimension beside the pipeline's
    coords = {r: {order[0]: r // 2, order[1]: r % 2} for r in range(4)}
    mine = coords[dist.get_rank()]
    groups: dict[str, Any] = {}
    for dim, other in (("pp", side), (side, "pp")):
        for fixed in range(2):  # collective: every rank makes every group, in the same order
            g = dist.new_group([r for r in range(4) if coords[r][other] == fixed], backend="gloo",
                               timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
            st.kept.append(g)  # not destroyed: DeviceMesh caches its sub-meshes, which name their groups
            if mine[other] == fixed:
                groups[dim] = g
    return DeviceMesh.from_group([groups[order[0]], groups[order[1]]], "cpu",
                                 mesh=torch.arange(4).reshape(2, 2), mesh_dim_names=order)


def _copies(d: Draw, st: DrawState) -> dict[str, Copy]:
    parts = whole_model(d)
    if d.ranks == 2:
        return {name: build(d, name, parts, st.group(), dist.get_rank()) for name in ("plain", "vpipe")}
    copies = {}
    for name in ("plain", "vpipe"):  # FSDP2 shards over the mesh's dp; plain replicas only all-reduce over it
        mesh = _mesh(d, st)
        if d.tp != "none":  # one pipeline, its blocks tensor-parallel: every tp rank trains replica 0's batch
            copies[name] = build(d, name, parts, mesh.get_group("pp"), mesh["pp"].get_local_rank(),
                                 tp_mesh=mesh["tp"])
            continue
        copies[name] = build(d, name, parts, mesh.get_group("pp"), mesh["pp"].get_local_rank(),
                             mesh["dp"] if d.fsdp else None, mesh["dp"].get_local_rank(),
                             mesh.get_group("dp"))
    if d.tp == "none" and copies["plain"].dp_group is copies["vpipe"].dp_group:
        raise RuntimeError("the two copies' meshes share their dp group")
    return copies


def train_draw(d: Draw, st: DrawState, log_file: Path, mixed_autodetect: bool) -> dict[str, Any]:
    """Build, attach, request the plans, train both copies, detach: this rank's results (collective)."""
    if d.engine == "deepspeed":  # both copies DeepSpeed engines: a trainer of their own
        from fuzz.deepspeed_draw import train_deepspeed

        return train_deepspeed(d, st, log_file)
    import vpipe
    from vpipe.plan import Plan, Policy

    copies = _copies(d, st)
    aux = st.group()  # global clipping's all-reduce, for both copies in turn
    st.phase = "attach"
    options: dict[str, Any] = {"planning": False, "min_swap_bytes": 0, "log_file": str(log_file),
                               "policies": dict(enumerate(d.policies)), "agree_timeout_s": GROUP_TIMEOUT_S}
    if d.shape == "mixed" and not mixed_autodetect:
        # blocks of two kinds: attach's own search can pick different containers on different stages (the MoE
        # block's ``experts`` list competes with ``layers``): before vpipe 89f2e3e blocks then moved between
        # unlike containers; now the stages agree on one path or attach says which to pass. Until attach finds
        # ``layers`` by itself every time, mixed draws name it (--mixed-autodetect leaves it out)
        options["layers"] = "layers"
    if d.moves == "planner":  # vpipe's own planner chooses the moves, as quickly as it can be told to
        options.update(planning=True, sample_every=1, apply_lag_steps=1,
                       planner_options={"warmup_samples": 1, "confirm_samples": 1, "cooldown_steps": 0})
    if d.nas_add:  # vp.add_layers builds the new block with the trainer's factory
        options["layer_factory"] = lambda layer_id, spec: _parallel(new_block(d, layer_id), copies["vpipe"])
    moved = copies["vpipe"]
    if moved.averages:
        options["carry"] = list(moved.averages)
    st.vp = vp = vpipe.attach(moved.schedule, optimizer=moved.optimizer_arg, **options)

    def request(after_edit: bool) -> None:
        for epoch, (at, counts, policies) in enumerate(d.plans, start=1):
            if (d.edit_step is not None and at >= d.edit_step) == after_edit:
                stages = d.plan_stages(at, counts)
                # an edit starts an epoch of its own: a plan after it with an epoch not above it is stale
                vp.request_plan(Plan(epoch=epoch + after_edit, stages=tuple(tuple(s) for s in stages),
                                     policies={i: Policy(policies[i]) for s in stages for i in s}),
                                at_step=at)

    request(after_edit=False)
    prints: dict[str, list] = {name: [] for name in copies}
    placements = [[list(s) for s in vp.placement]]
    for step in range(d.steps):
        # at the step boundary, on both copies, before either steps
        if d.nas_remove and step == d.nas_remove[0]:
            st.phase = f"remove_layers@{step}"
            remove_block(d, copies["plain"], d.nas_remove[1])
            vp.remove_layers([d.nas_remove[1]])
            request(after_edit=True)
        if d.nas_add and step == d.nas_add[0]:
            st.phase = f"add_layers@{step}"
            add_block(d, copies["plain"], d.nas_add[1], _parallel(new_block(d, d.layers), copies["plain"]))
            added = vp.add_layers(d.nas_add[1], [{"kind": "fuzz"}])
            if added != [d.layers]:
                raise AssertionError(f"vp.add_layers gave ids {added}, the plain copy added {d.layers}")
            request(after_edit=True)
        for name, c in copies.items():
            st.phase = f"train:{name}@{step}"
            train_step(d, c, step, aux)
            prints[name].append(fingerprint(d, c))
        placements.append([list(s) for s in vp.placement])
    for name, c in copies.items():
        st.phase = f"finish:{name}"
        finish(d, c)
    st.phase = "detach"
    held = {v: [getattr(b, "layer_id", type(b).__name__) for b in container(d, m).children()]
            for v, m in zip(moved.stages, moved.modules)}
    mismatch = {v: ids for v, ids in held.items() if ids != list(vp.placement[v])}
    vp.detach()
    st.phase = "snapshot"
    return {"rank": dist.get_rank(), "losses": {name: {c.replica: c.losses} for name, c in copies.items()},
            "prints": prints, "states": {name: snapshot(d, c) for name, c in copies.items()},
            "placements": placements, "mismatch": {str(k): v for k, v in mismatch.items()},
            "rss_mb": psutil.Process().memory_info().rss / 2**20}


def _parallel(block: Any, c: Copy) -> Any:
    """A new block as the copy's blocks are: tensor-parallel over its tp mesh where it has one."""
    if c.tp_mesh is None:
        return block
    from fuzz.tensor_parallel import parallelize_block

    return parallelize_block(block, c.tp_mesh)


def _short_default_timeout() -> None:
    """Every group made from here on without a timeout of its own (vpipe's transfer
    group, whose vote would wait 30 minutes for a rank whose move raised) gives up
    after GROUP_TIMEOUT_S, so a failed draw costs seconds."""
    from torch.distributed import distributed_c10d

    distributed_c10d._get_default_timeout = lambda backend: datetime.timedelta(seconds=GROUP_TIMEOUT_S)


def _agree_failed(ctrl: Any, failed: bool) -> bool:
    flag = torch.tensor([1 if failed else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctrl)
    return bool(flag.item())


def _resync_attaches(ctrl: Any) -> None:
    """After a failed draw some ranks may have counted an attach the others did not: every rank goes on
    from the highest count, so the next attach's store namespace is the same, fresh one everywhere."""
    from vpipe.rank import agreement

    n = torch.tensor([next(agreement._ATTACHES)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=ctrl)
    agreement._ATTACHES = itertools.count(int(n.item()) + 1)


def run_one(d: Draw, ctrl: Any, logs: Path, mixed_autodetect: bool) -> dict[str, Any] | None:
    """One draw on every rank; rank 0 gets its record (the others None)."""
    started = time.perf_counter()
    st = DrawState()
    log_file = logs / f"{d.seed}.log"
    if dist.get_rank() == 0:
        log_file.unlink(missing_ok=True)  # left by an earlier run of this seed
    local: dict[str, Any] | None = None
    error = None
    try:
        local = train_draw(d, st, log_file, mixed_autodetect)
    except Exception as e:  # noqa: BLE001 - a failing draw is a result: recorded, and the job goes on
        error = {"rank": dist.get_rank(), "phase": st.phase, "type": type(e).__name__,
                 "message": str(e)[:2000],
                 "traceback": traceback.format_exc()[-3000:]}
        print(f"rank {dist.get_rank()}: seed {d.seed} failed in {st.phase}\n{traceback.format_exc()}",
              file=sys.stderr,
              flush=True)
    failed = _agree_failed(ctrl, error is not None)
    st.cleanup()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error if failed else local, group=ctrl)
    if failed:
        _resync_attaches(ctrl)
    del local
    gc.collect()
    if dist.get_rank() != 0:
        return None
    seconds = time.perf_counter() - started
    if failed:
        return judge(d, None, [g for g in gathered if g is not None], log_file, seconds)
    return judge(d, gathered, [], log_file, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--logs", required=True)
    parser.add_argument("--seeds", required=True, help="comma-separated seeds")
    parser.add_argument("--fsdp-every", type=int, default=FSDP_EVERY)
    parser.add_argument("--draw-timeout", type=float, default=240.0)
    parser.add_argument("--mixed-autodetect", action="store_true", help="attach mixed draws without layers=")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--set", action="append", default=[],
                        help="override an axis of every draw: AXIS=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    seeds = [int(s) for s in args.seeds.split(",")]
    draws = {seed: override(draw(seed, args.fsdp_every), args.set) for seed in seeds}
    if any(d.engine == "deepspeed" for d in draws.values()):  # before any draw's timeout starts
        from fuzz.deepspeed_draw import warm_up

        warm_up()
    # the fuzzer's own group, used only where every rank arrives: it waits as long as a draw may take
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.draw_timeout + 60))
    _short_default_timeout()
    logs, out = Path(args.logs), Path(args.out)
    logs.mkdir(parents=True, exist_ok=True)
    for seed, d in draws.items():
        if d.ranks != dist.get_world_size():
            raise SystemExit(f"seed {seed} needs {d.ranks} ranks, this job has {dist.get_world_size()}")
        if dist.get_rank() == 0:
            _append(out, {"event": "start", "seed": seed})
        faulthandler.dump_traceback_later(args.draw_timeout, exit=True)
        record = run_one(d, ctrl, logs, args.mixed_autodetect)
        faulthandler.cancel_dump_traceback_later()
        if record is not None:
            import vpipe

            _append(out, {"event": "result", **record, "library": str(Path(vpipe.__file__).parent)})
            if record["outcome"] in ("identical", "close", "refused") and not args.keep_logs:
                (logs / f"{seed}.log").unlink(missing_ok=True)
    dist.barrier(group=ctrl)
    dist.destroy_process_group()


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")


if __name__ == "__main__":
    main()
