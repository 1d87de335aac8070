"""`vpipe train`'s outputs: checked before any rank starts, never written through a planted link, and a
write that fails mid-run said once while training goes on."""

from __future__ import annotations

import os

import pytest

from support.processes import run_vpipe

TINY = ["--blocks", "2", "--d-model", "16", "--seq-len", "8", "--no-progress"]
PRECIOUS = "another user's file, which vpipe must not touch\n"


def _refused(argv: list[str], capsys) -> str:
    from vpipe_lab.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def _foreign_checkpoint(ck) -> None:
    """A checkpoint another run wrote into ``ck`` (the writer the ranks use, in this process)."""
    import torch

    from vpipe.checkpoint import save_checkpoint

    class Store(dict):
        def set(self, key, value):
            self[key] = value.encode()

        def multi_get(self, keys):
            return [self[k] for k in keys]

    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    save_checkpoint(ck, 30, module=module, optimizer=None, rank=0, world_size=1, store=Store(),
                    run_id="earlier",
                    vpipe_state={"version": 1, "epoch": 0, "iteration": 30, "stages": [[0]], "policies": {},
                                 "next_layer_id": 1})


def test_a_directory_holding_another_runs_checkpoints_is_refused_at_start_unless_resumed(tmp_path, capsys):
    from vpipe_lab.runtime.checkpoints import check_checkpoint_dir
    from vpipe_lab.runtime.config import RunConfig

    ck = tmp_path / "ck"
    _foreign_checkpoint(ck)
    assert _refused(["train", "--steps", "15", "--checkpoint-dir", str(ck), "--checkpoint-every", "5"],
                    capsys) == (
        f"vpipe: error: --checkpoint-dir {ck} holds another run's checkpoints (the newest: "
        f"step-00000030); give this run a directory of its own, or --resume {ck} to continue that run")
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000030"]
    for resume in (ck, ck / "step-00000030"):  # --resume naming the directory, or one of its checkpoints
        check_checkpoint_dir(RunConfig(checkpoint_dir=str(ck), resume=str(resume), steps=40))


def test_a_planted_lock_link_ends_the_command_before_it_starts(tmp_path, capsys):
    ck, target = tmp_path / "ck", tmp_path / "victim"
    ck.mkdir(mode=0o777)
    target.write_text(PRECIOUS)
    (ck / ".vpipe-lock").symlink_to(target)
    assert _refused(["train", "--steps", "1", "--checkpoint-dir", str(ck)], capsys) == (
        f"vpipe: error: --checkpoint-dir {ck}: its lock file {ck / '.vpipe-lock'} is a "
        "symbolic link; vpipe never writes through one: remove it, or give this run a directory of its own")
    assert target.read_text() == PRECIOUS


@pytest.mark.parametrize("variable, enable", [("VPIPE_METRICS_DIR", ("VPIPE_METRICS", "tensorboard")),
                                              ("VPIPE_TRACE_DIR", ("VPIPE_TRACE_STEPS", "2,1"))])
def test_a_metrics_or_trace_directory_that_is_a_file_is_refused_at_start(tmp_path, capsys, monkeypatch,
                                                                         variable,
                                                                          enable):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(variable, str(blocker))
    monkeypatch.setenv(*enable)
    assert _refused(["train", "--steps", "1", "--vpipe"], capsys) == (
        f"vpipe: error: {variable} {blocker} is a file, not a directory")


def test_checkpoints_and_results_that_cannot_be_written_are_said_once_per_rank_and_training_finishes(
    tmp_path,
):
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    (ck / "step-00000002").write_text("in the way")  # the checkpoint after step 2 cannot be made
    (out / "rank1.json" / "in-the-way").mkdir(parents=True)  # nor rank 1's results
    proc = run_vpipe("train", *TINY, "--stages", "2", "--steps", "4", "--checkpoint-dir", str(ck),
                     "--checkpoint-every", "2", "--out-dir", str(out), timeout=180)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = sorted(line for line in proc.stderr.splitlines() if "cannot write" in line)
    assert said == [
        f"vpipe [rank 0]: cannot write the checkpoint after step 2 in {ck} (Not a "
        "directory); training goes on without checkpoints",
        f"vpipe [rank 1]: cannot write the checkpoint after step 2 in {ck} (Not a "
        "directory); training goes on without checkpoints",
        f"vpipe [rank 1]: cannot write this rank's results to {out} (Is a directory); training "
        "finished without them",
    ], proc.stderr[-3000:]
    assert not list(ck.glob("step-00000004"))  # dropped after the failure, on every rank alike
    assert sorted(p.name for p in out.iterdir()) == [".vpipe-lock", "rank0.json", "rank0.pt", "rank1.json",
                                                     "rank1.pt"]
    assert os.path.isdir(out / "rank1.json")
