"""Every benchmark script answers ``--help`` with its usage (a stray
``%`` in a help text made argparse crash)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))


def test_the_benchmarks_directory_has_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_help_prints_usage_and_exits_zero(script, capsys):
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_another_revision_loads_beside_this_checkout_with_its_own_modules(tmp_path):
    """benchmarks/revision.py: a change is timed against the code before it in one process."""
    import importlib
    import sys

    import vpipe.tensor_manager

    spec = importlib.util.spec_from_file_location("benchmark_revision_loader",
                                                  SCRIPTS[0].parent / "revision.py")
    revision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(revision)
    exported = revision.export_vpipe("HEAD", tmp_path / "base")
    assert (exported / "tensor_manager" / "swap.py").is_file()
    package, label = revision.load_vpipe(str(tmp_path / "base"))
    assert package.__name__ == f"vpipe_at_{label}" == "vpipe_at_base"
    other = importlib.import_module(f"{package.__name__}.tensor_manager")
    assert other.TensorManager is not vpipe.tensor_manager.TensorManager
    # its modules import each other, not this checkout's: the swap engine's ledger is its own
    swap = sys.modules[f"{package.__name__}.tensor_manager.swap"]
    assert swap.Ledger.__module__ == f"{package.__name__}.tensor_manager.accounting"
    with pytest.raises(SystemExit, match="exists already"):
        revision.export_vpipe("HEAD", tmp_path / "base")


def test_host_cost_counts_what_each_policy_adds_to_a_step():
    """benchmarks/host_cost.py: counted, not timed. Every layer kept with metering off (how attach runs the
    steps its monitor does not sample) dispatches exactly plain's tensor operations; swapping adds the
    prefetches' allocations and one batched copy per layer call."""
    spec = importlib.util.spec_from_file_location("benchmark_host_cost", SCRIPTS[0].parent / "host_cost.py")
    host_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_cost)
    args = argparse.Namespace(device="cpu", blocks=2, d_model=16, heads=2, seq_len=4, micro_batches=2,
                              micro_batch_size=1, min_swap_bytes=0, threads=1, only=["vpipe D", "vpipe S"],
                              against=None)
    threads = torch.get_num_threads()
    try:
        rows = {row["variant"]: row for row in host_cost.run(args)["rows"]}
    finally:
        # (run() sets the benchmark's own: later tests in this process keep theirs)
        torch.set_num_threads(threads)
    assert list(rows) == ["plain", "vpipe D", "vpipe S"]
    assert rows["plain"]["vpipe_bytecodes"] == 0 and rows["plain"]["operations_beyond_plain"] == 0
    assert rows["vpipe D"]["operations"] == rows["plain"]["operations"]
    swapped = dict(rows["vpipe S"]["most_beyond_plain"])
    assert swapped["aten._foreach_copy_"] > 0 and swapped["aten.empty_like"] > 0
    assert rows["vpipe S"]["vpipe_bytecodes"] > 10 * rows["vpipe D"]["vpipe_bytecodes"] > 0


def _uneven_projection():
    path = SCRIPTS[0].parent / "uneven_projection.py"
    spec = importlib.util.spec_from_file_location("benchmark_uneven_projection", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stages_at(costs, speeds, split, bottleneck):
    """How many stages of ``split`` take the bottleneck's time."""
    times, i = [], 0
    for speed, c in zip(speeds, split):
        times.append(speed * sum(costs[i:i + c]))
        i += c
    return sum(x >= bottleneck * (1 - 1e-9) for x in times)


def test_uneven_projection_split_is_the_exact_min_max_with_the_fewest_stages_at_it():
    """benchmarks/uneven_projection.py: the speed-aware split
    against every contiguous split of small chains."""
    import itertools
    import random

    uneven = _uneven_projection()
    rng = random.Random(0)
    for _ in range(60):
        n, p = rng.randint(1, 8), rng.randint(1, 4)
        if p > n:
            continue
        costs = [rng.choice([1.0, 2.0, 3.0, rng.uniform(0.5, 3)]) for _ in range(n)]
        speeds = [rng.choice([1.0, 1.5, 2.0, rng.uniform(0.5, 3)]) for _ in range(p)]
        counts = uneven.speed_aware_counts(costs, speeds)
        assert len(counts) == p and sum(counts) == n and min(counts) >= 1
        cuts = itertools.combinations(range(1, n), p - 1)
        splits = [[b - a for a, b in zip((0, *cut), (*cut, n))] for cut in cuts]
        objective = [uneven.slowest_stage_s(costs, speeds, split) for split in splits]
        best = min(objective)
        assert uneven.slowest_stage_s(costs, speeds, counts) == pytest.approx(best, rel=1e-9)
        at_bottleneck = [_stages_at(costs, speeds, split, best) for split in splits]
        fewest = min(at for at, v in zip(at_bottleneck, objective) if v <= best * (1 + 1e-9))
        assert _stages_at(costs, speeds, counts, best) == fewest


def test_uneven_projection_one_slow_stage_of_sixteen():
    """Identical blocks: the slow stage takes fewer, one stage takes the one left over, as early as it
    goes; the speed-aware split's step sits between the uniform devices' and the speed-blind split's."""
    uneven = _uneven_projection()
    assert uneven.even_counts(10, 4) == [3, 3, 2, 2]
    speeds = [1.0] * 16
    speeds[5] = 1.5
    assert uneven.speed_aware_counts([1.0] * 64, speeds) == [5, 4, 4, 4, 4, 3] + [4] * 10
    out = uneven.project(uneven.parse_args(["--no-planner"]))  # (the planner has its own tests)
    a, b, c = out["cases"][:3]
    assert a["counts"] == b["counts"] == [4] * 16 and c["counts"] == [5, 4, 4, 4, 4, 3] + [4] * 10
    assert b["slowest_stage_s"] == pytest.approx(1.5 * a["slowest_stage_s"])
    assert c["slowest_stage_s"] == pytest.approx(1.25 * a["slowest_stage_s"])
    assert a["step_s"] < c["step_s"] < b["step_s"]
    with pytest.raises(ValueError, match="cannot split 3 blocks into 4"):
        uneven.speed_aware_counts([1.0] * 3, [1.0] * 4)
