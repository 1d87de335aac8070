"""Thousands of blocks on one stage train with vpipe as they do without it.

Freeing a graph whose nodes have Python objects takes a few C stack frames per node (torch
gives a node one when Python reads its ``grad_fn``, or puts a hook on its tensor). vpipe's
tensor manager read ``grad_fn`` of every tensor it saw saved, and its monitor hooks every
block's output: a stage of about 3000 blocks died of SIGSEGV (a C stack overflow) when its
step's graph was freed, with only "exited first with code -11". Now the tensor manager asks
``is_leaf`` instead and the monitor frees the nodes it hooked one block at a time, so how
deep the graph is freed no longer grows with the number of blocks.
"""

from __future__ import annotations

import json

from support.processes import WORKERS, run_ranks, run_vpipe


def test_six_hundred_blocks_train_on_a_128_kib_stack(tmp_path):
    """The mechanism at a size the default suite affords: 600 blocks on a thread
    with a 128 KiB C stack (the old code overflowed it at 300 blocks, the main
    thread's 8 MiB at about 3000 of the lab's transformer blocks)."""
    out = tmp_path / "deep.json"
    run_ranks([str(WORKERS / "deep_worker.py"), "600", "128", str(out)], 1, tmp_path / "deep.txt",
              timeout_s=180)
    assert json.loads(out.read_text()) == {"steps": 3}


def test_three_thousand_blocks_on_one_stage_train_with_vpipe(tmp_path):
    """The reported run: about 3000 transformer blocks on stage 0 of 2 (it died of SIGSEGV in its second
    step), every step after the first sampled."""
    proc = run_vpipe("train", "--stages", "2", "--blocks", "3000", "--partition", "3000,2", "--d-model", "8",
                     "--n-heads", "1", "--seq-len", "4", "--steps", "3", "--vpipe", "--monitor-every", "1",
                     "--no-progress", "--out-dir", str(tmp_path / "out"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    held = json.loads((tmp_path / "out" / "rank0.json").read_text())["layer_ids"]
    assert held == list(range(3000))  # the embedding and 2999 blocks
