"""Step time and peak saved bytes of the tensor manager's policies vs no vpipe and torch's own tools.

One process runs a stage-sized model in GPipe order (every micro-batch's forward, then
every backward), which is what a pipeline stage sees, under each variant:

  plain        no vpipe, no hooks
  vpipe D      the tensor manager attached, every layer kept, as ``vpipe.attach`` runs the steps its
               monitor does not sample (metering off: kept layers measured, their hooks off)
  vpipe D metered  every layer kept, every call measured through the saved-tensor hooks (a sampled step)
  vpipe S      every layer swapped (pool, copy engine, prefetch)
  vpipe R      every layer recomputed
  vpipe 40%    a budget of 40% of the all-D peak; the manager picks swaps/recomputes itself
  save_on_cpu  torch.autograd.graph.save_on_cpu around each forward
  checkpoint   torch.utils.checkpoint (non-reentrant) per layer, no vpipe

Every vpipe variant but the metered one runs with metering off after the warm-up, as attach
runs its unsampled steps. ``--against REV`` adds each of ``vpipe D``, ``vpipe S`` and ``vpipe R``
compared as it was at another git revision (or in a directory holding its ``vpipe`` package),
``vpipe S @<rev>``: the change and the code before it timed in the same process
(``revision.py``). For swapping variants the copy time per step (device events) and
the share of it hidden under compute, 1 - (step - plain) / copy time, are reported too.

Variants alternate within each round (A B C ... then reversed), and a variant's time is
the median over rounds of its ratio to plain in the same round, so load from other
processes on a shared machine cancels out. Peak saved bytes are measured in a separate,
untimed step: the manager's own accounting for vpipe variants, a counting saved-tensor
hook for the others (it sees what torch's tools leave on the device).

    python benchmarks/tensor_manager_bench.py --rounds 7 --json OUT.json
    python benchmarks/tensor_manager_bench.py --device cpu --d-model 32 --heads 2 --seq-len 8 \
        --micro-batch-size 1 --min-swap-bytes 0 --only "vpipe S,save_on_cpu" --against HEAD~1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vpipe.plan import Policy  # noqa: E402
from vpipe.settings import process_settings  # noqa: E402
from vpipe.tensor_manager import TensorManager  # noqa: E402
from vpipe.tensor_manager.accounting import format_bytes  # noqa: E402
from vpipe_lab.runtime.models import build_model, transformer_lm  # noqa: E402


def prefetch_alloc_from_env() -> str:
    """Where this run's tensor managers allocate prefetched copies: ``VPIPE_PREFETCH_ALLOC``
    (the GPU suite sets ``compute`` for one run), ``copy`` when unset, read as
    ``vpipe.attach`` reads it (another value is refused)."""
    return process_settings().prefetch_alloc


VARIANTS = ("plain", "vpipe D", "vpipe D metered", "vpipe S", "vpipe R", "vpipe 40%", "save_on_cpu",
            "checkpoint")


class SavedBytesProbe:
    """Counts the distinct storages autograd holds through this hook, and their peak."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}
        self.resident = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        root = t if t._base is None else t._base
        if root.grad_fn is None and (root.requires_grad or isinstance(root, torch.nn.Parameter)):
            return t  # weights and views of them are not activations
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [storage.nbytes(), 0]
            self.resident += entry[0]
            self.peak = max(self.peak, self.resident)
        entry[1] += 1
        return _Held(self, key, t.detach() if t.grad_fn is not None else t)

    def unpack(self, held: Any) -> torch.Tensor:
        return held if isinstance(held, torch.Tensor) else held.tensor

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.resident -= entry[0]
            del self.live[key]


class _Held:
    __slots__ = ("probe", "key", "tensor")

    def __init__(self, probe: SavedBytesProbe, key: int, tensor: torch.Tensor) -> None:
        self.probe, self.key, self.tensor = probe, key, tensor

    def __del__(self) -> None:
        self.probe.release(self.key)


class Bench:
    """One model instance per variant (same initial weights), so managers stay attached throughout."""

    def __init__(self, args: argparse.Namespace, against: dict[str, Any] | None = None) -> None:
        """``against``: variant name -> (TensorManager class, Policy)
        of another revision, as ``vpipe S @<rev>``."""
        self.args = args
        self.device = torch.device(args.device)
        self.spec = transformer_lm(n_blocks=args.blocks, d_model=args.d_model, n_heads=args.heads,
                                   seq_len=args.seq_len, dropout=0.1)
        self.models = {v: build_model(self.spec, seed=0).to(self.device)
                       for v in (*VARIANTS, *(against or {}))}
        x, y = self.spec.batch(0, args.micro_batches * args.micro_batch_size, 0)
        self.inputs = [t.to(self.device) for t in x.tensor_split(args.micro_batches)]
        self.targets = [t.to(self.device) for t in y.tensor_split(args.micro_batches)]
        policies = {"vpipe D": Policy.KEEP, "vpipe D metered": Policy.KEEP, "vpipe S": Policy.SWAP,
                    "vpipe R": Policy.RECOMPUTE, "vpipe 40%": Policy.KEEP}
        self.managers = {
            v: TensorManager({int(n): c for n, c in self.models[v].named_children()}, device=self.device,
                             min_swap_bytes=args.min_swap_bytes, prefetch_alloc=prefetch_alloc_from_env(),
                             policies={int(n): policy for n, _ in self.models[v].named_children()})
            for v, policy in policies.items()
        }
        for v, (manager_class, policy) in (against or {}).items():
            layers = {int(n): c for n, c in self.models[v].named_children()}
            self.managers[v] = manager_class(layers, device=self.device, min_swap_bytes=args.min_swap_bytes,
                                             policies=dict.fromkeys(layers, policy))

    def step(self, variant: str, probe: SavedBytesProbe | None = None) -> None:
        model, manager = self.models[variant], self.managers.get(variant)
        loss_fn = self.spec.loss_fn()
        losses = []
        for mb, x in enumerate(self.inputs):
            # the probe sees what the model's layers leave saved, as the manager counts (not the loss)
            with torch.autograd.graph.saved_tensors_hooks(probe.pack,
                                                          probe.unpack) if probe else nullcontext():
                with self._forward_context(variant, mb):
                    out = model(x) if variant != "checkpoint" else self._checkpointed(model, x)
            losses.append(loss_fn(out, self.targets[mb]) / len(self.inputs))
        for mb, loss in enumerate(losses):
            with manager.backward(mb) if manager is not None else nullcontext():
                loss.backward()
        model.zero_grad(set_to_none=True)

    def _forward_context(self, variant: str, mb: int) -> Any:
        manager = self.managers.get(variant)
        if manager is not None:
            return manager.micro_batch(mb)
        if variant == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")
        return nullcontext()

    @staticmethod
    def _checkpointed(model: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        for layer in model:
            x = checkpoint(layer, x, use_reentrant=False)
        return x

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, variant: str) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.step(variant)
        self.sync()
        return time.perf_counter() - t0

    def peak_saved(self, variant: str) -> tuple[int, dict[str, Any]]:
        manager = self.managers.get(variant)
        if manager is None:
            probe = SavedBytesProbe()
            self.step(variant, probe)
            return probe.peak, {}
        manager.synchronize()  # every copy's time known, before and after
        manager.reset_peak()
        before = manager.stats()
        self.step(variant)
        manager.synchronize()
        s = manager.stats()
        return s.peak_resident_bytes, {  # the copies of this one step
            "d2h_bytes": s.d2h_bytes - before.d2h_bytes,
                                       "sync_fallbacks": s.sync_fallbacks - before.sync_fallbacks,
            "copy_s": (s.d2h_s - before.d2h_s) + (s.h2d_s - before.h2d_s),
            "prefetched": s.prefetched - before.prefetched,
            "policies": "".join(p.value for p in s.policies.values()), "budget": s.budget_bytes,
        }


def _against(source: str, variants: tuple[str, ...]) -> dict[str, Any]:
    """The kept, swapped and recomputed variants among ``variants``,
    with another revision's tensor manager."""
    import importlib

    from revision import load_vpipe

    package, label = load_vpipe(source)
    manager_class = importlib.import_module(package.__name__ + ".tensor_manager").TensorManager
    policy = importlib.import_module(package.__name__ + ".plan").Policy
    chosen = {"vpipe D": "D", "vpipe S": "S", "vpipe R": "R"}
    return {f"{v} @{label}": (manager_class, policy(chosen[v])) for v in variants if v in chosen}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    variants = ("plain",) + tuple(v for v in VARIANTS if v != "plain" and (not args.only or v in args.only))
    against = _against(args.against, variants) if args.against else {}
    variants += tuple(against)
    bench = Bench(args, against)
    all_kept, _ = bench.peak_saved("vpipe D")
    bench.managers["vpipe 40%"].budget_bytes = int(0.4 * all_kept)
    for _ in range(2):  # warm up the allocator, the pool and the managers' measurements
        for variant in variants:
            bench.timed(variant)
    for variant, manager in bench.managers.items():
        manager.metering = variant == "vpipe D metered"  # attach meters only the steps its monitor samples
    times: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else tuple(reversed(variants))
        got = {v: bench.timed(v) for v in order}
        for v in variants:
            times[v].append(got[v])
            ratios[v].append(got[v] / got["plain"])
    rows = []
    for v in variants:
        peak, extra = bench.peak_saved(v)
        if v == "save_on_cpu" and bench.device.type == "cpu":
            # it copies nothing when the graph is on the CPU already: the tensors stay where they are
            peak, extra = all_kept, {"note": "no copy on a CPU device"}
        if extra.get("copy_s"):  # how much of the copy time the step did not pay for
            extra["copy_hidden"] = max(0.0, 1.0 - max(0.0, statistics.median(times[v]) - statistics.median(
                times["plain"])) / extra["copy_s"])
        rows.append({
            "variant": v,
            "step_s": statistics.median(times[v]),
            "ratio_vs_plain": statistics.median(ratios[v]),
            "ratio_min": min(ratios[v]), "ratio_max": max(ratios[v]),
            "peak_saved_bytes": peak,
            "peak_vs_plain": peak / max(1, all_kept),
            **extra,
        })
    return {
        "config": {k: v for k, v in vars(args).items()
                   if k != "json"} | {"prefetch_alloc": prefetch_alloc_from_env()},
        "device": (f"{bench.device} ({torch.cuda.get_device_name(bench.device)})"
                   if bench.device.type == "cuda"
                   else str(bench.device)), "torch": torch.__version__, "all_kept_peak_bytes": all_kept,
            "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    table = Table(title=(f"tensor manager: {cfg['blocks']} blocks d={cfg['d_model']} T={cfg['seq_len']}, "
                         f"{cfg['micro_batches']} x {cfg['micro_batch_size']} micro-batches, GPipe order, "
                         f"{result['device']}, median of {cfg['rounds']} rounds"))
    for col in ("variant", "step", "vs plain", "range", "peak saved", "vs plain peak", "notes"):
        table.add_column(col, justify="left" if col in ("variant", "notes") else "right")
    for row in result["rows"]:
        notes = [row["note"]] if "note" in row else []
        if "policies" in row:
            notes.append(f"policies {row['policies']}")
            if row["budget"]:
                notes.append(f"budget {format_bytes(row['budget'])}")
            if row["d2h_bytes"]:
                notes.append(f"swaps {format_bytes(row['d2h_bytes'])}/step, "
                             f"{row['sync_fallbacks']} sync fallbacks")
            if row.get("copy_hidden") is not None:
                notes.append(f"copies {row['copy_s'] * 1e3:.1f} ms/step, {row['copy_hidden']:.0%} hidden")
        table.add_row(row["variant"], f"{row['step_s'] * 1e3:.1f} ms", f"{row['ratio_vs_plain']:.3f}",
                      f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f}", format_bytes(row["peak_saved_bytes"]),
                      f"{row['peak_vs_plain']:.2f}", "; ".join(notes))
    Console(width=160).print(table)


def add_bench_arguments(p: argparse.ArgumentParser, variants: tuple[str, ...], *, device: str, d_model: int,
                        heads: int, seq_len: int, micro_batch_size: int, min_swap_bytes: int) -> None:
    """The model, the variants and ``--against``, with these defaults (``host_cost.py`` shares them)."""
    p.add_argument("--device", default=device)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--d-model", type=int, default=d_model)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=micro_batch_size)
    p.add_argument("--min-swap-bytes", type=int, default=min_swap_bytes)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", type=lambda text: text.split(","), default=None,
                   help="compare plain with these variants only (comma-separated: "
                        + ", ".join(variants[1:]).replace("%", "%%") + ")")
    p.add_argument("--against", default=None, metavar="REV",
                   help="also run vpipe D/S/R as at this git revision, or from a directory "
                        "holding its vpipe package")
    p.add_argument("--json", default=None, help="also write the results here")


def parse_bench_arguments(p: argparse.ArgumentParser, variants: tuple[str, ...],
                          argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    unknown = set(args.only or ()) - set(variants)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {', '.join(variants)}")
    return args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(p, VARIANTS, device="cuda" if torch.cuda.is_available() else "cpu", d_model=256,
                        heads=4,
                        seq_len=128, micro_batch_size=8, min_swap_bytes=64 * 1024)
    p.add_argument("--rounds", type=int, default=7)
    args = parse_bench_arguments(p, VARIANTS, argv)
    result = run(args)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
