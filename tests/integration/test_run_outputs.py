"""What a run writes is its own: two runs given the same ``--out-dir``, ``--log-file`` or trace directory, and the
second is refused in one line, as a second run on one checkpoint directory is (it used to replace the first's results
and timeline and interleave the logs in silence)."""

from __future__ import annotations

import subprocess
import sys

from support.processes import ROOT, child_env, run_vpipe

TINY = ["--blocks", "2", "--d-model", "16", "--seq-len", "8", "--no-progress"]
HOLD = """
import sys, time
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.outputs import claim_outputs
claim_outputs(RunConfig(out_dir=sys.argv[1], log_file=sys.argv[2], vpipe=True), hold=True)  # as rank 0 does
print("held", flush=True)
time.sleep(600)
"""


def _refused(argv: list[str], capsys) -> str:
    from vpipe_lab.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# ---------------------------------------------------------------------- one run's outputs at a time
def test_an_out_dir_log_file_or_trace_directory_another_run_holds_is_refused_in_one_line(tmp_path, capsys,
                                                                                          monkeypatch):
    out, log, trace = tmp_path / "out", tmp_path / "run.log", tmp_path / "trace"
    env = child_env(VPIPE_TRACE_STEPS="2,1", VPIPE_TRACE_DIR=str(trace))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out), str(log)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        train = ["train", *TINY, "--steps", "1"]
        assert _refused([*train, "--out-dir", str(out)], capsys) == (
            f"vpipe: error: --out-dir {out} is in use by another run (pid {holder.pid}); give each run a directory of "
            "its own")
        assert _refused([*train, "--log-file", str(log)], capsys) == (
            f"vpipe: error: --log-file {log} is being written by another run; give each run a log file of its own")
        monkeypatch.setenv("VPIPE_TRACE_STEPS", "2,1")
        monkeypatch.setenv("VPIPE_TRACE_DIR", str(trace))
        assert _refused([*train, "--vpipe"], capsys) == (
            f"vpipe: error: VPIPE_TRACE_DIR {trace} is in use by another run (pid {holder.pid}); give each run a "
            "directory of its own")
        assert _refused(["nas", *TINY, "--out-dir", str(out)], capsys).startswith(f"vpipe: error: --out-dir {out} is")
    finally:
        holder.kill()
        holder.wait()
    from vpipe_lab.runtime.config import RunConfig
    from vpipe_lab.runtime.outputs import claim_outputs

    claim_outputs(RunConfig(out_dir=str(out), log_file=str(log), vpipe=True), hold=False)  # free once it is gone


def test_a_second_training_run_on_the_same_outputs_is_refused_while_the_first_trains(tmp_path):
    """The whole path: the first run's rank 0 holds them while it trains; the second's launcher refuses."""
    out, log, trace = tmp_path / "out", tmp_path / "run.log", tmp_path / "trace"
    env = child_env(VPIPE_TRACE_STEPS="100000,1", VPIPE_TRACE_DIR=str(trace))
    args = ["train", *TINY, "--vpipe", "--no-planning", "--out-dir", str(out), "--log-file", str(log)]
    first = subprocess.Popen([sys.executable, "-m", "vpipe_lab", *args, "--steps", "100000"], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        from support.processes import ranks_training, wait_while_running

        wait_while_running(lambda: ranks_training(log) == 2, 120, "the first run's ranks training", first)
        pid = int((out / ".vpipe-lock").read_text())
        for given, said in [(["--out-dir", str(out)], f"--out-dir {out} is in use by another run (pid {pid})"),
                            (["--log-file", str(log)], f"--log-file {log} is being written by another run"),
                            (["--vpipe"], f"VPIPE_TRACE_DIR {trace} is in use by another run (pid {pid})")]:
            second = run_vpipe("train", *TINY, "--steps", "2", *given, env=env, timeout=120)
            assert second.returncode == 2 and second.stderr.startswith(f"vpipe: error: {said}"), second.stderr
    finally:
        first.kill()
        first.wait()
