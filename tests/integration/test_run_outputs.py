"""What a run writes is its own, and the small ones of reliability round 5.

- Two runs given the same ``--out-dir``, ``--log-file`` or trace directory: the second is refused
  in one line, as a second run on one checkpoint directory is (it used to replace the first's
  results and timeline and interleave the logs in silence).
- A run of ``vpipe train`` under a umask of 000 makes its files ``0600`` and its directories ``0700`` (they
  were ``0666`` / ``0777``; in-process: ``tests/unit/test_output_modes.py``), and writes the
  ``VPIPE_LOG_FILE`` it checks (it never wrote to it).
- A 100,000-character value is cut in the one line that refuses it (it was echoed in full).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import ROOT, child_env, run_vpipe
from vpipe.settings import process_settings

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
            f"vpipe: error: --out-dir {out} is in use by another run (pid {holder.pid}); give "
            "each run a directory of its own")
        assert _refused([*train, "--log-file", str(log)], capsys) == (
            f"vpipe: error: --log-file {log} is being written by another run; give each run "
            "a log file of its own")
        monkeypatch.setenv("VPIPE_TRACE_STEPS", "2,1")
        monkeypatch.setenv("VPIPE_TRACE_DIR", str(trace))
        process_settings.cache_clear()  # the next command reads them, as a new process would
        assert _refused([*train, "--vpipe"], capsys) == (
            f"vpipe: error: VPIPE_TRACE_DIR {trace} is in use by another run (pid "
            f"{holder.pid}); give each run a directory of its own")
        assert _refused(["nas", *TINY, "--out-dir", str(out)],
                        capsys).startswith(f"vpipe: error: --out-dir {out} is")
    finally:
        holder.kill()
        holder.wait()
    from vpipe_lab.runtime.config import RunConfig
    from vpipe_lab.runtime.outputs import claim_outputs

    # free once it is gone
    claim_outputs(RunConfig(out_dir=str(out), log_file=str(log), vpipe=True), hold=False)


def test_a_second_training_run_on_the_same_outputs_is_refused_while_the_first_trains(tmp_path):
    """The whole path: the first run's rank 0 holds them while it trains; the second's launcher refuses."""
    out, log, trace = tmp_path / "out", tmp_path / "run.log", tmp_path / "trace"
    env = child_env(VPIPE_TRACE_STEPS="100000,1", VPIPE_TRACE_DIR=str(trace))
    args = ["train", *TINY, "--vpipe", "--no-planning", "--out-dir", str(out), "--log-file", str(log)]
    first = subprocess.Popen([sys.executable, "-m", "vpipe_lab", *args, "--steps", "100000"], cwd=ROOT,
                             env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        from support.processes import ranks_training, wait_while_running

        wait_while_running(lambda: ranks_training(log) == 2, 120, "the first run's ranks training", first)
        pid = int((out / ".vpipe-lock").read_text())
        for given, said in [(["--out-dir", str(out)],
                             f"--out-dir {out} is in use by another run (pid {pid})"),
                            (["--log-file", str(log)], f"--log-file {log} is being written by another run"),
                            (["--vpipe"], f"VPIPE_TRACE_DIR {trace} is in use by another run (pid {pid})")]:
            second = run_vpipe("train", *TINY, "--steps", "2", *given, env=env, timeout=120)
            assert second.returncode == 2 and second.stderr.startswith(f"vpipe: error: {said}"), second.stderr
    finally:
        first.kill()
        first.wait()


# ---------------------------------------------------------------------- private whatever the umask
def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


def test_a_run_under_umask_000_makes_its_files_0600_and_directories_0700_and_writes_vpipe_log_file(tmp_path):
    base = tmp_path / "made"
    log = base / "logs" / "run.log"
    env = child_env(VPIPE_LOG_FILE=str(log), VPIPE_TRACE_STEPS="1,1", VPIPE_TRACE_DIR=str(base / "trace"))
    proc = subprocess.run([sys.executable, "-m", "vpipe_lab", "train", *TINY, "--steps", "2", "--vpipe",
                           "--no-planning", "--out-dir", str(base / "out"), "--checkpoint-dir",
                           str(base / "ck")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
                          preexec_fn=lambda: os.umask(0))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from vpipe.log import read_log

    # the variable the launcher checked, written by each rank
    assert {r["rank"] for r in read_log(log)} == {0, 1}
    modes = _modes(base)
    made = {"logs/run.log", "out/rank0.pt", "out/rank1.json", "ck/step-00000002/manifest.json",
            "trace/timeline-rank0.json", "trace/timeline-rank1.json", "out/.vpipe-lock"}
    assert made <= set(modes), sorted(modes)
    wrong = {name: oct(mode) for name, mode in modes.items()
             if mode != (0o700 if (base / name).is_dir() else 0o600)}
    assert not wrong, wrong


def test_vpipe_train_and_nas_take_their_run_log_from_vpipe_log_file(tmp_path, monkeypatch):
    """The launcher checked VPIPE_LOG_FILE and no rank wrote to it; the run above has the ranks write it."""
    from vpipe_lab.cli import build_parser, config_from_args

    monkeypatch.setenv("VPIPE_LOG_FILE", str(tmp_path / "env.log"))
    for command in ("train", "nas"):
        assert config_from_args(build_parser().parse_args([command])).log_file == str(tmp_path / "env.log")
        flag = build_parser().parse_args([command, "--log-file", str(tmp_path / "flag.log")])
        assert config_from_args(flag).log_file == str(tmp_path / "flag.log")  # the flag wins


# ---------------------------------------------------------------------- overlong values
LONG = "x" * 100_000


@pytest.mark.parametrize("argv, env", [
    (["train", "--steps", "1", "--log-file", LONG], {}),
    (["train", "--steps", "1", "--out-dir", LONG], {}),
    (["train", "--steps", "1", "--checkpoint-dir", LONG], {}),
    (["train", "--steps", "1", "--resume", LONG], {}),
    (["train", "--steps", "1", "--vpipe", "--planner", LONG], {}),
    (["train", "--steps", "1", "--vpipe"], {"VPIPE_LOG_FILE": LONG}),
    (["train", "--steps", "1", "--vpipe"], {"VPIPE_TRACE_DIR": LONG, "VPIPE_TRACE_STEPS": "1,1"}),
    (["plot", "run.log", "-o", LONG], {}),
    (["trace", LONG], {}),
], ids=["log-file", "out-dir", "checkpoint-dir", "resume", "planner", "VPIPE_LOG_FILE", "VPIPE_TRACE_DIR",
        "plot",
        "trace"])
def test_a_100000_character_value_is_cut_in_the_line_that_refuses_it(capsys, monkeypatch, argv, env):
    from vpipe_lab.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and len(err) < 600, err[:300]
    assert "x" * 79 + "... (100,00" in err, err[:300]


@pytest.mark.parametrize("argv", [["train", "--partition", LONG], ["train", "--moves", LONG],
                                  ["train", "--model", LONG]])
def test_argparse_errors_cut_an_overlong_value_too(capsys, argv):
    from vpipe_lab.cli import main

    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert len(err) < 2000 and "x" * 79 + "... (100,00" in err, err[-300:]
