"""`vpipe train` behaves as torchrun users expect: one stage per rank, and --resume on a fresh directory."""

from __future__ import annotations

import subprocess
import sys

from support.processes import ROOT, child_env, run_vpipe

SMALL = ["--blocks", "2", "--d-model", "16", "--seq-len", "8", "--micro-batches", "4", "--micro-batch-size",
         "1",
         "--no-progress"]


def test_under_torchrun_the_stages_default_to_the_number_of_ranks(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
         "vpipe_lab",
         "train", "--steps", "2", "--out-dir", str(out), *SMALL],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("rank*.pt")) == [f"rank{r}.pt" for r in range(4)]


def test_resume_from_a_directory_without_checkpoints_starts_fresh_and_says_so(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run_vpipe("train", "--steps", "2", "--checkpoint-dir", str(ckpt), "--resume", str(ckpt), *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"vpipe: --resume {ckpt}: no checkpoint there yet; starting from step 0" in proc.stderr
    assert list(ckpt.glob("step-*/manifest.json"))  # and it wrote one, so the next launch resumes from it
    empty = run_vpipe("train", "--steps", "2", "--resume", "", *SMALL)
    assert empty.returncode == 2 and "Traceback" not in empty.stderr
    assert "argument --resume: needs a directory (an empty name would train from scratch)" in empty.stderr
