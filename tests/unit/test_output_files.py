"""What vpipe writes: never through a link another user planted, and a failed write never ends training.

Each test plants what another user of a shared directory could (a symbolic link at a name vpipe
writes, or a name taken before vpipe gets there), or makes a write fail, and checks what vpipe did
with it: the link's target is untouched, the pair or temporary is gone, the failure is said once.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from vpipe import timeline
from vpipe.files import FileCheckError

PRECIOUS = "another user's file, which vpipe must not touch\n"


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_text(PRECIOUS)
    return path


def shared(tmp_path: Path, name: str = "shared") -> Path:
    """A directory every user can write to, as the issue's ``shared/ck``."""
    path = tmp_path / name
    path.mkdir()
    path.chmod(0o777)
    return path


# ---------------------------------------------------------------------- links planted where vpipe writes
def test_a_planted_lock_link_leaves_its_target_unchanged(tmp_path):
    from vpipe.checkpoint import CheckpointError
    from vpipe_lab.runtime import checkpoints, outputs
    from vpipe_lab.runtime.config import RunConfig

    target, ck = victim(tmp_path), shared(tmp_path, "ck")
    (ck / ".vpipe-lock").symlink_to(target)
    held = dict(outputs._held)
    try:
        with pytest.raises(CheckpointError,
                           match=r"\.vpipe-lock is a symbolic link; vpipe never writes through one"):
            checkpoints.check_checkpoint_dir(RunConfig(checkpoint_dir=str(ck)), hold=True)  # rank 0's call
    finally:
        for key in set(outputs._held) - set(held):  # what the unfixed code kept: the truncated victim
            os.close(outputs._held.pop(key))
    assert target.read_text() == PRECIOUS


def _record_window(directory: Path, rank: int = 0) -> Path | None:
    timeline.start(rank, directory, [rank])
    with timeline.span("vpipe.forward", timeline.COMPUTE, rank, micro_batch=0):
        pass
    return timeline.stop()


def test_a_planted_timeline_temporary_link_leaves_its_target_unchanged(tmp_path):
    target, trace_dir = victim(tmp_path), shared(tmp_path, "trace")
    (trace_dir / "timeline-rank0.json.tmp").symlink_to(target)
    written = _record_window(trace_dir)
    assert target.read_text() == PRECIOUS
    assert written == trace_dir / "timeline-rank0.json" and not written.is_symlink()
    assert len(timeline.load_rank_file(written).events) == 1
    assert sorted(p.name for p in trace_dir.iterdir()) == ["timeline-rank0.json", "timeline-rank0.json.tmp"]


def test_a_planted_trace_output_temporary_link_leaves_its_target_unchanged(tmp_path, capsys):
    from vpipe.cli import main

    target, out_dir = victim(tmp_path), shared(tmp_path, "out")
    _record_window(tmp_path / "run")
    (out_dir / "trace.json.tmp").symlink_to(target)
    assert main(["trace", str(tmp_path / "run"), "-o", str(out_dir / "trace.json")]) == 0
    assert target.read_text() == PRECIOUS
    assert json.loads((out_dir / "trace.json").read_text())["traceEvents"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["trace.json", "trace.json.tmp"]


def test_a_planted_run_log_link_leaves_its_target_unchanged_and_a_link_of_ones_own_still_works(tmp_path):
    from vpipe import log
    from vpipe.output_paths import check_output_file

    target, directory = victim(tmp_path), shared(tmp_path)
    planted = directory / "run.log"
    planted.symlink_to(target)
    reason = (r"log file .*run\.log is a symbolic link in a directory other users can change; "
              r"vpipe does not write")
    with pytest.raises(FileCheckError, match=reason):
        check_output_file(planted, "log file")  # at start: one line, exit 2
    try:
        with pytest.raises(FileCheckError, match=reason):  # and where the ranks open it
            log.configure(planted, rank=0)
        log.decision("plan", "a decision that must not reach the victim")
    finally:
        log.configure(None)
    assert target.read_text() == PRECIOUS
    mine = tmp_path / "mine"  # a link of this user's, in a directory only this user can change
    mine.mkdir(mode=0o755)
    (mine / "run.log").symlink_to(tmp_path / "real.log")
    try:
        log.configure(mine / "run.log", rank=0)
        log.decision("plan", "through the link")
    finally:
        log.configure(None)
    assert [r["msg"] for r in log.read_log(tmp_path / "real.log")] == ["through the link"]


def test_key_directories_are_private_whatever_the_umask_and_a_half_written_pair_is_removed(tmp_path):
    from vpipe.control.keys import KeyFileError, write_keypair

    old = os.umask(0)
    try:
        public, secret = write_keypair(tmp_path / "keys", "a")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and stat.S_IMODE(public.stat().st_mode) == 0o644
    (tmp_path / "keys" / "b.key").write_text("someone's public key")  # the public half's name is taken
    with pytest.raises(KeyFileError, match="b.key exists; vpipe keys never overwrites a key file"):
        write_keypair(tmp_path / "keys", "b")
    assert not (tmp_path / "keys" / "b.key_secret").exists()  # no secret without its public half
    assert (tmp_path / "keys" / "b.key").read_text() == "someone's public key"


# ---------------------------------------------------------------------- checkpoints belong to a run
class _Store:
    """The run's store, for one rank."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.values[k] for k in keys]


def _save(root: Path, step: int, run_id: str) -> None:
    from vpipe.checkpoint import save_checkpoint

    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    state = {"version": 1, "epoch": 0, "iteration": step, "stages": [[0, 1]], "policies": {},
             "next_layer_id": 2}
    save_checkpoint(root, step, module=module, optimizer=None, rank=0, world_size=1, store=_Store(),
                    vpipe_state=state, run_id=run_id)


def test_a_run_prunes_only_its_own_checkpoints(tmp_path):
    from vpipe.checkpoint import load_checkpoint

    root = tmp_path / "ck"
    for step in (10, 20, 30):  # --steps 30 --checkpoint-every 10
        _save(root, step, "first")
    for step in (5, 10, 15):  # then --steps 15 --checkpoint-every 5 in the same directory
        _save(root, step, "second")
    runs = {d.name: load_checkpoint(d).run for d in sorted(root.glob("step-*"))}
    assert runs == {"step-00000010": "second", "step-00000015": "second", "step-00000020": "first",
                    # each run kept its newest two; the first's step 10 was replaced
                    "step-00000030": "first"}


# ---------------------------------------------------------------------- outputs that fail later
def test_a_failing_metrics_write_is_reported_once_and_training_goes_on(tmp_path, capfd):
    pytest.importorskip("tensorboard")
    from vpipe.rank.metrics import MetricsWriter

    writer = MetricsWriter(("tensorboard",), tmp_path / "metrics", rank=1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer._tensorboard.add_scalar = full  # as the event file's writer does on a full disk
    for step in range(5):
        writer.step(step, 0.1, 0, {1: (2, None)}, [])
    writer.close()
    assert capfd.readouterr().err.splitlines() == [
        f"vpipe [rank 1]: cannot write the metrics to {tmp_path / 'metrics' / 'rank1'} (No "
        "space left on device); training goes on, and its further metrics are dropped"]


def test_a_metrics_directory_that_is_a_file_is_refused_where_vpipe_attaches(tmp_path):
    pytest.importorskip("tensorboard")
    from vpipe.rank.metrics import MetricsWriter

    blocker = tmp_path / "metrics"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"^metrics_dir {blocker} is a file, not a directory$"):
        MetricsWriter(("tensorboard",), blocker, rank=0)


def test_a_failing_timeline_write_is_reported_once_and_leaves_no_temporary_file(tmp_path, capfd):
    trace_dir = tmp_path / "trace"
    (trace_dir / "timeline-rank0.json" / "in-the-way").mkdir(parents=True)  # the rename cannot replace it
    with pytest.raises(OSError):  # the trace window (vpipe.rank.tracing) logs it and training goes on
        _record_window(trace_dir)
    assert sorted(p.name for p in trace_dir.iterdir()) == ["timeline-rank0.json"]
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"vpipe [rank 0]: cannot write the timeline {trace_dir}")
    assert err[0].endswith("; training goes on without it")
