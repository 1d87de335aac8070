"""One GPU whose memory the activations outgrow: vpipe's own swap/recompute mix vs torch's tools.

The vPipe claim at one stage. A transformer runs in GPipe order (every micro-batch's
forward, then every backward: what a pipeline stage holds at its peak) on one GPU whose
memory is capped (``torch.cuda.set_per_process_memory_fraction``) so that the plain step
fits ``--fits`` micro-batches and no more. Then, at twice that batch:

  vpipe        the tensor manager with ``budget_bytes`` = 0.8 x what plain's largest batch saves;
               it escalates layers to swap (S) or recompute (R) itself, cheapest first
  checkpoint   ``torch.utils.checkpoint`` (non-reentrant) on every block: GPipe's all-recompute
  save_on_cpu  ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: every saved tensor on the host

Samples per second at that batch (rounds in ABBA order, median), and for each system the
largest batch (in micro-batches) that fits the cap and runs within 10% of plain's
per-sample throughput at plain's largest batch. A batch that does not fit is reported as
such (the allocator's out-of-memory error), not estimated.

``VPIPE_PREFETCH_ALLOC=compute`` in the environment has vpipe's prefetched copies allocated from the
compute stream's memory instead of the copy stream's (recorded in the JSON's config).

    python benchmarks/memory_bound_bench.py --json OUT.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

# the cap is on the allocator's reservations: expandable segments keep fragmentation from deciding what fits
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tensor_manager_bench import SavedBytesProbe, prefetch_alloc_from_env  # noqa: E402
from vpipe.plan import Policy  # noqa: E402
from vpipe.tensor_manager import TensorManager  # noqa: E402
from vpipe_lab.runtime.models import build_model, transformer_lm  # noqa: E402

SYSTEMS = ("plain", "vpipe", "checkpoint", "save_on_cpu")
WITHIN = 1.10  # "within 10% of plain's per-sample throughput"
BUDGET_SHARE = 0.8


class OutOfMemory(Exception):
    """The step did not fit the memory cap."""


class Runner:
    """Two copies of one model (same weights): one managed by vpipe, one for plain and torch's tools."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.spec = transformer_lm(n_blocks=args.blocks, d_model=args.d_model, n_heads=args.heads,
                                   seq_len=args.seq_len, dropout=0.0)
        self.model = build_model(self.spec, seed=0).to(self.device)
        self.managed = build_model(self.spec, seed=0).to(self.device)
        self.manager = TensorManager({int(n): c for n, c in self.managed.named_children()},
                                     device=self.device,
                                     policies={int(n): Policy.KEEP for n, _ in self.managed.named_children()},
                                     prefetch_alloc=prefetch_alloc_from_env())
        self.loss_fn = self.spec.loss_fn()
        self.batches: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def batch(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if n not in self.batches:
            self.batches.clear()  # one batch size on the device at a time
            x, y = self.spec.batch(0, n * self.args.micro_batch_size, 0)
            self.batches[n] = ([t.to(self.device) for t in x.tensor_split(n)],
                               [t.to(self.device) for t in y.tensor_split(n)])
        return self.batches[n]

    def step(self, system: str, n: int, probe: SavedBytesProbe | None = None,
             forwards: AbstractContextManager[Any] | None = None) -> None:
        """One GPipe-ordered step of ``n`` micro-batches; :class:`OutOfMemory` if it did not fit.
        ``forwards``: a context around all the forwards (a profiler's range)."""
        inputs, targets = self.batch(n)
        model = self.managed if system == "vpipe" else self.model
        try:
            losses = []
            with forwards or nullcontext():
                for mb, x in enumerate(inputs):
                    hooks = (torch.autograd.graph.saved_tensors_hooks(probe.pack, probe.unpack) if probe
                             else nullcontext())
                    with hooks, self._forward_context(system, mb):
                        out = self._checkpointed(model, x) if system == "checkpoint" else model(x)
                    losses.append(self.loss_fn(out, targets[mb]) / n)
                    del out
            for mb in range(n):  # GPipe's backward order (torch's ScheduleGPipe)
                with self.manager.backward(mb) if system == "vpipe" else nullcontext():
                    losses[mb].backward()
                losses[mb] = None  # type: ignore[call-overload]
        except torch.OutOfMemoryError as e:
            if system == "vpipe":
                self.manager.synchronize()
            del losses  # the graphs of the micro-batches that ran
            model.zero_grad(set_to_none=True)
            gc.collect()
            self.sync()
            torch.cuda.empty_cache()
            raise OutOfMemory(str(e).splitlines()[0]) from None
        model.zero_grad(set_to_none=True)
        if system == "vpipe":
            self.manager.relax()  # as vpipe.attach does at every step boundary

    def _forward_context(self, system: str, mb: int) -> Any:
        if system == "vpipe":
            return self.manager.micro_batch(mb, ())
        if system == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")
        return nullcontext()

    @staticmethod
    def _checkpointed(model: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        children = list(model)
        for i, layer in enumerate(children):
            # the blocks are recomputed; the embedding and the head are kept, as GPipe's recompute does
            x = checkpoint(layer, x, use_reentrant=False) if 0 < i < len(children) - 1 else layer(x)
        return x

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, system: str, n: int) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.step(system, n)
        self.sync()
        return time.perf_counter() - t0

    def alloc_retries(self) -> int:
        """How often the allocator had to free its cache and retry so far (0 on CPU)."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def peak_bytes(self, system: str, n: int) -> int:
        """The device's peak allocated bytes during one step (CPU: 0, nothing to cap)."""
        if self.device.type != "cuda":
            return 0
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.step(system, n)
        self.sync()
        return int(torch.cuda.max_memory_allocated(self.device))


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model and memory arguments this benchmark and ``gpu_timeline.py`` share."""
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--fits", type=int, default=4,
                   help="micro-batches plain's capped memory holds (default 4)")
    p.add_argument("--threads", type=int, default=1)


def set_budget(runner: Runner, cap: dict[str, Any]) -> int:
    """vpipe's own setting: what plain's largest batch saves, less a fifth for the copies in flight and the
    allocator's separate pools for the copy streams."""
    runner.manager.budget_bytes = int(runner.args.fits * cap["saved_per_micro_batch_bytes"] * BUDGET_SHARE)
    return runner.manager.budget_bytes


def cap_memory(runner: Runner, fits: int) -> dict[str, Any]:
    """Cap the device memory so that plain fits ``fits`` micro-batches; returns what the cap is made of."""
    probe = SavedBytesProbe()
    runner.step("plain", 1, probe)
    saved_per_mb = probe.peak
    peak1, peak2 = runner.peak_bytes("plain", 1), runner.peak_bytes("plain", 2)
    info: dict[str, Any] = {"saved_per_micro_batch_bytes": saved_per_mb}
    if runner.device.type != "cuda":
        return {**info, "cap_bytes": None}
    # what one more micro-batch adds to the real peak (saved tensors, allocator rounding)
    per_mb = peak2 - peak1
    fixed = peak1 - per_mb  # weights, gradients, the working set of one micro-batch
    cap = fixed + int(fits * per_mb * 1.02) + (64 << 20)
    total = torch.cuda.get_device_properties(runner.device).total_memory
    runner.sync()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, runner.device)
    return {**info, "cap_bytes": cap, "fixed_bytes": fixed, "per_micro_batch_bytes": per_mb,
            "device_bytes": total}


def largest_batch(runner: Runner, system: str, sizes: list[int], per_sample_limit: float | None,
                  steps: int, stop_when_slow: bool = False) -> dict[str, Any]:
    """The batches of ``sizes`` that fit, their per-sample time, and the largest
    within ``per_sample_limit`` (``stop_when_slow``: none larger is tried once one is
    over it, for systems whose time per sample only grows)."""
    tried = []
    for n in sizes:
        try:
            runner.step(system, n)  # warm-up: allocator, pool, the manager's measurements and escalations
            times = [runner.timed(system, n) for _ in range(steps)]
        except OutOfMemory as e:
            tried.append({"micro_batches": n, "fits": False, "error": e.args[0][:200]})
            break
        per_sample = statistics.median(times) / (n * runner.args.micro_batch_size)
        tried.append({"micro_batches": n, "fits": True, "per_sample_s": per_sample})
        if stop_when_slow and per_sample_limit is not None and per_sample > per_sample_limit:
            break
    ok = [t["micro_batches"] for t in tried if t["fits"]
          and (per_sample_limit is None or t["per_sample_s"] <= per_sample_limit)]
    return {"tried": tried, "largest": max(ok) if ok else None}


def _over(rows: dict[str, dict[str, Any]], a: str, b: str) -> float | None:
    x, y = rows[a].get("samples_per_s"), rows[b].get("samples_per_s")
    return x / y if x and y else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    runner = Runner(args)
    cap = cap_memory(runner, args.fits)
    budget = set_budget(runner, cap)
    n = 2 * args.fits
    # plain at its largest batch: the per-sample throughput every system is held to
    plain = largest_batch(runner, "plain", [args.fits, args.fits + 1, n], None, args.steps)
    plain_fits = plain["largest"]
    plain_row = next(t for t in plain["tried"] if t["micro_batches"] == plain_fits) if plain_fits else None
    limit = plain_row["per_sample_s"] * WITHIN if plain_row else None
    systems, at_batch = [], {}
    for system in SYSTEMS[1:]:  # warm up at the compared batch
        try:
            runner.step(system, n)
            systems.append(system)
        except OutOfMemory as e:
            at_batch[system] = {"fits": False, "error": e.args[0][:200], "samples_per_s": None}
    runner.manager.metering = False  # as vpipe.attach runs the steps its monitor does not sample
    before = runner.manager.stats()
    times: dict[str, list[float]] = {s: [] for s in systems}
    # the allocator freeing its cache (a device sync) to fit
    retries: dict[str, int] = dict.fromkeys(systems, 0)
    for r in range(args.rounds):
        for system in list(systems if r % 2 == 0 else reversed(systems)):
            try:
                before_retries = runner.alloc_retries()
                times[system].append(runner.timed(system, n))
                retries[system] += runner.alloc_retries() - before_retries
            except OutOfMemory as e:  # it fit its first step, not a later one: say so, measure the others
                systems.remove(system)
                at_batch[system] = {"fits": False, "error": f"round {r}: {e.args[0][:200]}",
                                    "samples_per_s": None}
                del times[system]
    stats = runner.manager.stats()  # (before the peak's untimed step)
    samples = n * args.micro_batch_size
    for system, t in times.items():
        step = statistics.median(t)
        at_batch[system] = {"fits": True, "step_s": step, "samples_per_s": samples / step,
                            "alloc_retries": retries[system] / len(t)}
        try:  # the device's own peak beside the manager's count: what the cap sees
            at_batch[system]["device_peak_bytes"] = runner.peak_bytes(system, n)
        except OutOfMemory:
            at_batch[system]["device_peak_bytes"] = None
    at_batch["vpipe"].update(
        policies="".join(p.value for p in stats.policies.values()),
        peak_saved_bytes=stats.peak_resident_bytes,
        escalations=len(stats.escalations),
        escalated=[f"{lid}:{old.value}->{new.value}" for lid, old, new in stats.escalations],
        sync_fallbacks=stats.sync_fallbacks,
        # per timed step: packs that waited for late swap-outs, and how long
        budget_waits=(stats.budget_waits - before.budget_waits) / args.rounds,
        budget_wait_s=(stats.budget_wait_s - before.budget_wait_s) / args.rounds,
        # per timed step: the copies' device time (events), and the share of it the step
        # did not pay for against plain's per-sample time at its largest batch
        copy_s=((stats.d2h_s - before.d2h_s) + (stats.h2d_s - before.h2d_s)) / args.rounds,
    )
    vpipe_row = at_batch["vpipe"]
    if vpipe_row.get("step_s") and plain_row and vpipe_row["copy_s"] > 0:
        exposed = max(0.0, vpipe_row["step_s"] - plain_row["per_sample_s"] * samples)
        vpipe_row["copy_hidden"] = max(0.0, 1.0 - exposed / vpipe_row["copy_s"])
    sizes = sorted({args.fits * k // 2 for k in range(2, 2 * args.max_factor + 1)})
    largest = {"plain": plain} | {s: largest_batch(runner, s, sizes, limit, args.steps,
                                                   stop_when_slow=s != "vpipe")
                                  for s in SYSTEMS[1:]}
    return {
        "config": {k: v for k, v in vars(args).items()
                   if k != "json"} | {"prefetch_alloc": prefetch_alloc_from_env()},
        "device": f"{runner.device} ({torch.cuda.get_device_name(runner.device)})"
            if runner.device.type == "cuda"
        else str(runner.device),
        "torch": torch.__version__, "memory": cap, "budget_bytes": budget, "micro_batches": n,
        "at_twice_plain": at_batch,
        "vpipe_over_checkpoint": _over(at_batch, "vpipe", "checkpoint"),
        "vpipe_over_save_on_cpu": _over(at_batch, "vpipe", "save_on_cpu"),
        "plain_largest": plain_fits, "per_sample_limit_s": limit, "largest": largest,
        "vpipe_largest_over_plain": (largest["vpipe"]["largest"] / plain_fits
                                     if plain_fits and largest["vpipe"]["largest"] else None),
    }


def print_summary(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(f"memory-bound: {cfg['blocks']} blocks d={cfg['d_model']} T={cfg['seq_len']}, micro-batches of "
          f"{cfg['micro_batch_size']}, {result['device']}, torch {result['torch']}")
    cap = result["memory"].get("cap_bytes")
    print(f"  cap {cap / 2**30:.2f} GiB" if cap else "  no memory cap (CPU)",
          f"budget {result['budget_bytes'] / 2**20:.0f} MiB; plain fits "
          f"{result['plain_largest']} micro-batches")
    for system, row in result["at_twice_plain"].items():
        if not row["fits"]:
            print(f"  {system:12s} at {result['micro_batches']} micro-batches: does not fit ({row['error']})")
            continue
        extra = f"  policies {row['policies']}, {row['escalations']} escalations" if "policies" in row else ""
        if row.get("alloc_retries"):
            extra += f", {row['alloc_retries']:g} allocator retries per step"
        if "copy_hidden" in row:
            extra += f", copies {row['copy_s'] * 1e3:.1f} ms/step, {row['copy_hidden']:.0%} hidden"
        print(f"  {system:12s} at {result['micro_batches']} micro-batches: "
              f"{row['samples_per_s']:8.1f} samples/s"
              + extra)
    print(f"  vpipe / checkpoint {result['vpipe_over_checkpoint']}, "
          f"vpipe / save_on_cpu {result['vpipe_over_save_on_cpu']}")
    for system, found in result["largest"].items():
        print(f"  largest batch within 10% of plain per sample, {system}: {found['largest']} micro-batches "
              + " ".join(f"[{t['micro_batches']}: "
                         f"{'%.2f ms' % (t['per_sample_s'] * 1e3) if t['fits'] else 'OOM'}]"
                         for t in found["tried"]))
    print(f"  vpipe's largest / plain's: {result['vpipe_largest_over_plain']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_model_arguments(p)
    p.add_argument("--max-factor", type=int, default=4, help="try batches up to this many times plain's")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2,
                   help="timed steps per batch size in the largest-batch search")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.fits < 1 or args.max_factor < 2:
        p.error("--fits must be at least 1 and --max-factor at least 2")
    result = run(args)
    print_summary(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
