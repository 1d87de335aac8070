"""Input that once reached a traceback: each now gets one line that says what is wrong, and exit code 2."""

from __future__ import annotations

import json
import os

import pytest

from support.processes import run_vpipe

NODE = {"fwd_ms": 1.0, "bwd_ms": 2.0, "act_bytes": 1, "param_bytes": 1}


def _graph(tmp_path, **first) -> str:
    nodes = [{"id": 0, "order": 0, **NODE, **first}, {"id": 1, "order": 1, **NODE}]
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"nodes": nodes, "edges": [[0, 1, 10]]}))
    return str(path)


def _one_line(proc, text: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == text


@pytest.mark.parametrize("first, text", [
    ({"act_bytes": 10**400},
     "vpipe: error: node 0 (0) has act_bytes of 401 digits, larger than any machine (at "
                             "most 4611686018427387904 bytes)"),
    ({"fwd_ms": 1e308}, "vpipe: error: node 0 (0) has a fwd time of 1e+305 s, beyond any real layer (at most "
                        "1e+06 s per micro-batch)"),
])
def test_a_graph_with_impossible_numbers_is_refused(tmp_path, first, text):
    _one_line(run_vpipe("plan", _graph(tmp_path, **first), "--stages", "2", timeout=60), text)


def test_a_json_nested_beyond_reason_is_refused_not_a_recursion_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    _one_line(run_vpipe("plan", str(deep), "--stages", "2", timeout=60),
              f"vpipe: error: graph file {str(deep)!r} nests its JSON too deeply to be a layer graph")
    log = tmp_path / "run.log"
    record = {"t": 1.0, "rank": 0, "logger": "vpipe.decisions", "level": "INFO", "event": "attached",
              "msg": "vpipe attached to stage 0 of 2"}
    log.write_text(json.dumps(record) + "\n" + '{"a": ' + "[" * 100_000 + "\n")
    proc = run_vpipe("logs", str(log), timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "attached" in proc.stdout


def test_plot_into_a_missing_directory_says_so(tmp_path):
    log = tmp_path / "run.log"
    log.write_text('{"event": "attached", "t": 1.0}\n')
    _one_line(
        run_vpipe("plot", str(log), "-o", "/nonexistent/dir/x.png", timeout=60),
        "vpipe plot: cannot write /nonexistent/dir/x.png: the directory /nonexistent/dir does not exist",
    )


def test_plot_names_the_log_and_the_record_whose_number_is_not_a_number(tmp_path):
    log = tmp_path / "run.log"
    log.write_text('{"event": "attached", "t": 1.0}\n{"logger": "vpipe.steps", "t": 2.0, '
                   '"rank": 1, "step_s": 0.5, "micro_batches": "abc"}\n')
    _one_line(run_vpipe("plot", str(log), "-o", str(tmp_path / "x.png"), timeout=60),
              f"vpipe plot: {log}: a vpipe.steps record (rank 1) has micro_batches='abc', not a number")


def test_bench_json_naming_a_file_for_several_benchmarks_says_so(tmp_path):
    out = tmp_path / "results"
    out.write_text("")
    _one_line(run_vpipe("bench", "memory", "overhead", "--json", str(out), timeout=60),
              f"vpipe: error: --json {out}: is a file; with 2 benchmarks --json names a "
              "directory for NAME.json and bench.json (a .json file only for one NAME)")


def test_a_budget_below_the_weights_ends_the_run_with_one_line_per_rank_and_no_traceback():
    proc = run_vpipe("train", "--memory-budget", "1", "--vpipe", "--steps", "2", "--blocks", "2", "--d-model",
                     "16",
                     "--seq-len", "8", "--no-progress")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("vpipe")]
    assert any("rank 0 failed: MemoryBudgetError: stage 0: parameters, gradients, "
               "optimizer state and stashed weight versions take"
               in line and line.endswith("the memory budget is 1 bytes")
               for line in lines)
    assert len(proc.stderr.strip().splitlines()) <= 4, proc.stderr


def test_a_full_disk_for_the_run_log_is_reported_once_per_rank_and_training_finishes():
    proc = run_vpipe("train", "--log-file", "/dev/full", "--vpipe", "--steps", "40", "--blocks", "2",
                     "--d-model", "16", "--seq-len", "8", "--no-progress")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for rank in (0, 1):
        said = [line for line in proc.stderr.splitlines()
                if line.startswith(f"vpipe [rank {rank}]: cannot write")]
        assert said == [f"vpipe [rank {rank}]: cannot write the run log /dev/full (No space left on device); "
                        "training goes on, and its further log records are dropped"], proc.stderr[-3000:]


# --------------------------------------------------------------------- paths: what they are, checked at start
@pytest.fixture
def paths(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    regular = tmp_path / "file"
    regular.write_text("x")
    return {"<fifo>": str(fifo), "<dir>": str(tmp_path), "<file>": str(regular),
            "<png>": str(tmp_path / "o.png")}


@pytest.mark.parametrize("argv, text", [
    ("plan /dev/zero --stages 2", "graph file /dev/zero is a device, not a regular file"),
    ("plan <fifo> --stages 2", "graph file <fifo> is a FIFO, not a regular file"),
    ("logs /dev/zero", "log file /dev/zero is a device, not a regular file"),
    ("logs <fifo>", "log file <fifo> is a FIFO, not a regular file"),
    ("plot /dev/zero -o <png>", "log file /dev/zero is a device, not a regular file"),
    ("plot <fifo> -o <png>", "log file <fifo> is a FIFO, not a regular file"),
    ("planner --connect tcp://127.0.0.1:9 --server-key=<fifo>",
     "CURVE key file <fifo> is a FIFO, not a regular file"),
    ("planner --connect tcp://127.0.0.1:9 --server-key=/dev/zero",
     "CURVE key file /dev/zero is a device, not a regular file"),
    ("planner --connect tcp://127.0.0.1:9 --log-file <dir>",
     "log file <dir> is a directory, not a file to write to"),
    ("train --steps 1 --log-file <fifo>", "log file <fifo> is a FIFO, not a file to write to"),
    ("train --steps 1 --log-file <dir>", "log file <dir> is a directory, not a file to write to"),
    ("train --steps 1 --out-dir <file>", "out_dir <file> is a file, not a directory"),
    ("train --steps 1 --checkpoint-dir <file>", "checkpoint_dir <file> is a file, not a directory"),
    ("train --steps 1 --out-dir <file>/sub", "out_dir <file>/sub: <file> is a file, not a directory"),
    ("train --steps 1 --resume <file>",
     "resume <file> is a file; give a checkpoint directory (or the directory of checkpoints)"),
])
def test_paths_that_are_not_what_they_should_be_are_refused_at_start(paths, capsys, argv, text):
    from vpipe_lab.cli import main

    for name, path in paths.items():
        argv, text = argv.replace(name, path), text.replace(name, path)
    assert main(argv.split()) == 2
    err = capsys.readouterr().err
    prefix = "vpipe plot: " if argv.startswith("plot") else "vpipe: error: "
    assert err.strip() == prefix + text and "Traceback" not in err


def test_an_empty_log_file_name_is_refused_at_start(capsys):
    from vpipe_lab.cli import main

    assert main(["train", "--steps", "1", "--log-file", ""]) == 2
    assert capsys.readouterr().err.strip() == "vpipe: error: log file is empty; give a file name"


VPIPE_ONLY = "--memory-budget and --policy are vpipe's (its tensor manager): add --vpipe"


@pytest.mark.parametrize("argv, text", [
    ("train --steps 1 --lr inf", "lr must be a positive finite number, got inf"),
    ("train --steps 1 --lr nan", "lr must be a positive finite number, got nan"),
    ("train --steps 1 --memory-budget 1G", VPIPE_ONLY),
    ("train --steps 1 --policy R", VPIPE_ONLY),
    ("train --steps 1 --vertical-sync",
     "vertical_sync is a PipeDream option; gpipe keeps no weight versions"),
    ("nas --schedule pipedream",
     "vpipe nas adds and removes layers, which needs a flush schedule (any but pipedream)"),
    ("nas --checkpoint-dir <dir>", "vpipe nas writes no checkpoints and cannot resume from one: drop "
                                   "--checkpoint-dir/--resume"),
    ("planner --connect tcp://127.0.0.1:9 --idle-timeout nan", "--heartbeat (0.5) must be > 0 and below "
                                                               "--idle-timeout (nan), both finite"),
    ("keys <file>", "key directory <file> is a file, not a directory"),
    ("keys /dev/full", "key directory /dev/full is a device, not a directory"),
    ("keys /proc/vpipe-keys", "cannot make key directory /proc/vpipe-keys: No such file or directory"),
    ("demo --log-dir <file>", "--log-dir <file> is a file, not a directory"),
])
def test_options_that_would_be_ignored_or_crash_are_refused_with_one_line(paths, capsys, argv, text):
    test_paths_that_are_not_what_they_should_be_are_refused_at_start(paths, capsys, argv, text)


def test_ctrl_c_is_reported_as_an_interruption_not_a_failure(tmp_path):
    import signal
    import subprocess
    import sys

    from support.processes import ROOT, child_env, ranks_training, wait_while_running
    from vpipe.log import read_log

    log_file = tmp_path / "run.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "vpipe_lab", "train", "--steps", "100000", "--blocks", "2", "--d-model", "16",
         "--seq-len", "8", "--no-progress", "--monitor-every", "5", "--log-file", str(log_file)],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_while_running(lambda: log_file.exists() and sum("control_endpoint" in r
                                                             for r in read_log(log_file)) >= 2,
                           120, "both ranks' control inboxes", launcher)
        wait_while_running(lambda: ranks_training(log_file) == 2, 120, "both ranks training", launcher)
        launcher.send_signal(signal.SIGINT)  # as Ctrl-C does (the launcher passes it on to every rank)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr and "failed" not in stderr, stderr
    assert stderr.splitlines()[-1].startswith("vpipe: interrupted (SIGINT); every rank stopped (exit codes: ")


@pytest.mark.parametrize("argv, env, text", [
    ("train --steps 1", {"VPIPE_CURVE_SECRET_FILE": "/nonexistent",
                         "VPIPE_CURVE_PUBLIC_KEYS": "/nonexistent"},
     "CURVE key file /nonexistent does not exist"),
    ("train --steps 1", {"VPIPE_CONTROL_HOST": "999.1.1.1"},
     "VPIPE_CONTROL_HOST='999.1.1.1': expected an IP address of this host (or 0.0.0.0 for every interface)"),
    ("plan --model torch.nn:Identity --input-shape 100000000,32 --stages 2", {},
     "--input-shape 100000000,32 is 3.2e+09 elements per micro-batch; profiling runs the "
     "model on it, so at most 2.68e+08 (one micro-batch, not the whole batch)"),
    ("plan --model <models>:exits --stages 2", {},
     "--model: <models>:exits() called sys.exit(0) instead of returning a model"),
])
def test_bad_settings_end_the_command_before_it_starts_with_one_line(paths, capsys, monkeypatch, argv, env,
                                                                     text):
    from support.processes import ROOT

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    paths = dict(paths, **{"<models>": str(ROOT / "tests" / "support" / "plan_models.py")})
    test_paths_that_are_not_what_they_should_be_are_refused_at_start(paths, capsys, argv, text)


def test_plot_writes_exactly_the_file_named_or_says_why_not(tmp_path, capsys):
    from support.run_logs import plotted_log
    from vpipe_lab.cli import main

    log = plotted_log(tmp_path / "run.log", steps=6)
    assert main(["plot", str(log), "-o", "/dev/full"]) == 2  # was written to /dev/full.png
    assert capsys.readouterr().err.strip() == "vpipe plot: cannot write -o /dev/full: No space left on device"
    assert main(["plot", str(log), "-o", ""]) == 2  # was written to .png
    assert capsys.readouterr().err.strip() == "vpipe plot: -o is empty; give the PNG file to write"
    assert main(["plot", str(log), "-o", str(tmp_path / "plain")]) == 0
    assert (tmp_path / "plain").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (
        tmp_path / "plain.png"
    ).exists()


def test_two_runs_cannot_share_a_checkpoint_directory(tmp_path):
    import signal
    import subprocess
    import sys

    from support.processes import ROOT, child_env, wait_while_running

    ck = tmp_path / "ck"
    args = ["train", "--steps", "100000", "--blocks", "2", "--d-model", "16", "--seq-len", "8",
            "--no-progress",
            "--checkpoint-dir", str(ck)]
    first = subprocess.Popen([sys.executable, "-m", "vpipe_lab", *args], cwd=ROOT, env=child_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock = ck / ".vpipe-lock"
        wait_while_running(lambda: lock.exists() and lock.read_text().strip() != "", 120,
              "the first run's lock", first)
        owner = (ck / ".vpipe-lock").read_text().strip()
        second = run_vpipe(*args[:2], "2", *args[3:], timeout=180)
    finally:
        first.send_signal(signal.SIGINT)  # the launcher passes it on: the ranks end, rank 0's lock with it
        try:
            first.wait(timeout=60)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
    _one_line(second,
              f"vpipe: error: --checkpoint-dir {ck} is in use by another run (pid {owner}); give each run "
                      "a directory of its own")
    from vpipe_lab.runtime.checkpoints import check_checkpoint_dir
    from vpipe_lab.runtime.config import RunConfig

    check_checkpoint_dir(RunConfig(checkpoint_dir=str(ck)))  # free again once the first run is gone


@pytest.mark.parametrize("flag, value", [("--network-bandwidth", "1e-300"), ("--copy-bandwidth", "1e300")])
def test_a_bandwidth_no_link_has_is_refused_not_planned_with(tmp_path, capsys, flag, value):
    from vpipe_lab.cli import main

    assert main(["plan", _graph(tmp_path), "--stages", "2", flag, value]) == 2  # printed a step of 1e300 ms
    assert capsys.readouterr().err.strip() == (f"vpipe: error: {flag} must be between "
                                               f"1000 and 1e+15 bytes/s, got {value!r}")


@pytest.mark.parametrize("argv, text", [
    ("train --steps 1 --planner nosuchmod:fn",
     "vpipe: error: --planner nosuchmod:fn: no statistics reach a planner without --vpipe "
     "or --monitor-every K"),
    ("train --steps 1 --vpipe --planner nosuchmod_xyz:fn",
     "vpipe: error: --planner nosuchmod_xyz:fn: no module 'nosuchmod_xyz' to import (give "
     "MODULE:FUNCTION, the module importable from here)"),
    ("keys <dir>/keys --name ",
     "vpipe: error: --name '': give a file name stem (letters, digits, - and _), or "
                                "leave --name out for this host's name"),
])
def test_a_planner_that_would_be_ignored_or_missing_and_an_empty_key_name_are_refused(paths, capsys, argv,
                                                                                      text):
    """A missing --planner module used to print an error and exit 0; --planner without --vpipe was ignored;
    --name '' fell back to the host's name."""
    from vpipe_lab.cli import main

    argv = argv.replace("<dir>", paths["<dir>"])
    assert main(argv.split(" ")) == 2
    assert capsys.readouterr().err.strip() == text
    assert not os.path.exists(os.path.join(paths["<dir>"], "keys"))


def test_json_nested_beyond_reason_in_a_manifest_a_timeline_nas_edits_or_planner_config_is_one_line(tmp_path):
    deep = "[" * 60_000 + "]" * 60_000
    step = tmp_path / "ck" / "step-00000001"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(deep)
    traces = tmp_path / "trace"
    traces.mkdir()
    (traces / "timeline-rank0.json").write_text(deep)
    cases = [
        (("train", "--steps", "2", "--resume", str(tmp_path / "ck")),
         f"vpipe: error: checkpoint manifest {step / 'manifest.json'} nests its JSON too "
         "deeply to be a manifest"),
        (("trace", str(traces), "-o", str(tmp_path / "t.json")),
         f"vpipe: error: {traces / 'timeline-rank0.json'} is not a vpipe timeline file (its "
         "JSON nests too deeply)"),
        (("train", "--steps", "1", "--vpipe", "--nas", deep),
         "vpipe train: error: argument --nas: its JSON nests too deeply to be a list of edits"),
        (("planner", "--connect", "tcp://127.0.0.1:9", "--planner-config", deep),
         "vpipe: error: --planner-config nests its JSON too deeply to be a planner's configuration"),
    ]
    for argv, text in cases:
        proc = run_vpipe(*argv, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == text
