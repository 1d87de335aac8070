"""Every benchmark script answers ``--help`` with its usage (a stray ``%`` in a help text made argparse crash)."""

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

    spec = importlib.util.spec_from_file_location("benchmark_revision_loader", SCRIPTS[0].parent / "revision.py")
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
    """benchmarks/host_cost.py: counted, not timed. Every layer kept with metering off (how attach runs the steps
    its monitor does not sample) dispatches exactly plain's tensor operations; swapping adds the prefetches'
    allocations and one batched copy per layer call."""
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
        torch.set_num_threads(threads)  # (run() sets the benchmark's own: later tests in this process keep theirs)
    assert list(rows) == ["plain", "vpipe D", "vpipe S"]
    assert rows["plain"]["vpipe_bytecodes"] == 0 and rows["plain"]["operations_beyond_plain"] == 0
    assert rows["vpipe D"]["operations"] == rows["plain"]["operations"]
    swapped = dict(rows["vpipe S"]["most_beyond_plain"])
    assert swapped["aten._foreach_copy_"] > 0 and swapped["aten.empty_like"] > 0
    assert rows["vpipe S"]["vpipe_bytecodes"] > 10 * rows["vpipe D"]["vpipe_bytecodes"] > 0
