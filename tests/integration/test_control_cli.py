"""`vpipe logs` renders a run's decisions; `vpipe planner` refuses bad arguments clearly."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from support.processes import ROOT, child_env, run_vpipe
from vpipe.control.daemon import NO_CHANGE_PLANNER, _server_key, build_parser
from vpipe.control.planner_function import load_planner, parse_planner_config
from vpipe.control.planner_link import daemon_arguments, manual_command
from vpipe.planner import DEFAULT_PLANNER
from vpipe.planner.online import OnlineConfig, OnlinePlanner, srp
from vpipe_lab.logview import timeline_rows


def write_log(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n")


RECORDS = [
    {"t": 100.0, "rank": 1, "logger": "vpipe.runtime", "level": "INFO", "msg": "stage 1 of 2: training"},
    {"t": 100.5, "rank": 1, "logger": "vpipe.decisions", "level": "INFO", "event": "planner_started",
     "pid": 77,
     "msg": "started planner daemon pid 77"},
    {"t": 101.25, "rank": None, "role": "planner", "logger": "vpipe.decisions", "level": "INFO",
     "event": "plan",
     "epoch": 3, "layers_per_stage": [5, 3], "predicted_step_s": 0.123456, "msg": "plan epoch 3: rebalance"},
    {"t": 102.0, "rank": 1, "logger": "vpipe.decisions", "level": "WARNING", "event": "planner_lost",
     "reason": "no message", "msg": "planner lost"},
    {"t": 102.5, "rank": 0, "logger": "vpipe.control", "level": "WARNING",
     "msg": "dropped a bad control message"},
]


def test_timeline_rows_show_time_since_start_who_event_and_numbers():
    rows = timeline_rows(RECORDS)
    assert [(r[0].strip(), r[1], r[2]) for r in rows] == [
        ("0.500", "1", "planner_started"), ("1.250", "planner", "plan"), ("2.000", "1", "planner_lost")]
    assert rows[1][3] == "plan epoch 3: rebalance"
    details = rows[1][4]
    assert (
        "epoch=3" in details and "layers_per_stage=[5, 3]" in details and "predicted_step_s=0.1235" in details
    )
    assert len(timeline_rows(RECORDS, everything=True)) == 5
    assert [r[2] for r in timeline_rows(RECORDS, events={"plan"})] == ["plan"]


def test_vpipe_logs_prints_a_table(tmp_path):
    log_file = tmp_path / "run.log"
    write_log(log_file, RECORDS)
    proc = run_vpipe("logs", str(log_file), env=None)
    assert proc.returncode == 0, proc.stderr
    for text in ("planner_started", "plan epoch 3: rebalance", "planner_lost", "planner"):
        assert text in proc.stdout
    assert "dropped a bad control message" not in proc.stdout
    proc = run_vpipe("logs", str(log_file), "--all")
    assert "dropped a bad control message" in proc.stdout


def test_vpipe_logs_on_a_missing_file_is_a_clear_error(tmp_path):
    proc = run_vpipe("logs", str(tmp_path / "nope.log"))
    assert proc.returncode == 2
    assert f"vpipe: error: log file {tmp_path / 'nope.log'} does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_vpipe_planner_refuses_bad_arguments():
    proc = run_vpipe("planner", "--connect", "tcp://0.0.0.0")
    assert proc.returncode == 2 and "endpoint must look like tcp://HOST:PORT" in proc.stderr
    proc = run_vpipe("planner", "--connect", "tcp://127.0.0.1:5", "--planner", "no_such_mod_q:f")
    assert proc.returncode == 2 and "cannot import planner module 'no_such_mod_q'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_planner_gives_up_when_no_run_answers(tmp_path):
    proc = run_vpipe("planner", "--connect", "tcp://127.0.0.1:9", "--heartbeat", "0.1", "--idle-timeout", "1",
                     timeout=60)
    assert proc.returncode == 1
    assert "nothing from tcp://127.0.0.1:9 for 1 s; exiting" in proc.stderr


def test_the_daemon_entry_point_imports_no_torch():
    """The last stage starts `python -m vpipe.control.daemon`: it must attach in well under a second."""
    code = ("import sys, runpy; sys.argv = ['x', '--help']\n"
            "try:\n    runpy.run_module('vpipe.control.daemon', run_name='__main__')\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--server-key" in proc.stdout and proc.stdout.strip().endswith("[]")


def test_decision_rows_show_an_edit_once_and_only_the_asked_events():
    from vpipe_lab.logview import decision_rows

    records = [{"t": 1.0, "rank": r, "logger": "vpipe.decisions", "event": "layers_added", "msg": "added"}
               for r in (1, 0)]
    records += [{"t": 2.0, "rank": None, "role": None, "logger": "vpipe.decisions", "event": "plan",
                 "msg": "p"},
                {"t": 3.0, "rank": 1, "logger": "vpipe.decisions", "event": "plan_received", "msg": "r"}]
    rows = decision_rows(records, {"layers_added", "plan"})
    assert [(who, event) for _, who, event, _, _ in rows] == [("0", "layers_added"), ("-", "plan")]


def test_a_server_key_beginning_with_a_dash_reaches_the_daemon():
    """Z85 keys may begin with '-' (1 in 85): as two words argparse took one for an option, the daemon
    exited with a usage error and the run trained without a planner (seen in the CURVE multihost test)."""
    key = b"-4zKfyWc0QhVTtUM:hb4ktg>Xj0Ex74V-JOhHNZ%"
    started = daemon_arguments("tcp://10.0.0.2:4100", "m:f", parent_pid=7, heartbeat_s=0.5, server_key=key,
                               log_file=None)
    assert _server_key(build_parser().parse_args(started).server_key) == key
    by_hand = shlex.split(manual_command("tcp://10.0.0.2:4100", key))
    assert by_hand[:2] == ["vpipe", "planner"]
    assert _server_key(build_parser().parse_args(by_hand[2:]).server_key) == key


def test_the_planner_configuration_reaches_the_daemon_as_data():
    """What the last stage starts the daemon with is what the
    planner is made with: no environment in between."""
    config = {"schedule": "zbv", "micro_batches": 6, "in_flight": [4, 2], "stage_ranks": [0, 0],
              "in_flight_together": [[4, 0], [2, 2]], "smoothing": 0.3}
    started = daemon_arguments("tcp://10.0.0.2:4100", DEFAULT_PLANNER, parent_pid=7, heartbeat_s=0.5,
                               server_key=None,
                               log_file=None, planner_config=config)
    args = build_parser().parse_args(started)
    planner = load_planner(args.planner, parse_planner_config(args.planner_config))
    assert isinstance(planner, OnlinePlanner)
    assert planner.config == OnlineConfig(**config)
    assert load_planner(DEFAULT_PLANNER) is srp  # no configuration: the defaults, made on the first vector


@pytest.mark.parametrize("planner, config, message", [
    (DEFAULT_PLANNER, "{schedule: 1f1b}", "--planner-config is not valid JSON: "),
    (DEFAULT_PLANNER, "[1, 2]", "--planner-config must be a JSON object, got list"),
    (DEFAULT_PLANNER, '{"smoothin": 0.5}', "planner config has unknown keys: smoothin"),
    (DEFAULT_PLANNER, '{"smoothing": 0}', "planner config: smoothing must be in (0, 1], got 0"),
    (DEFAULT_PLANNER, '{"min_gain": "high"}', "planner config: '<=' not supported"),
    (NO_CHANGE_PLANNER, "{}", f"planner {NO_CHANGE_PLANNER} takes no configuration"),
])
def test_a_bad_planner_configuration_is_named(planner, config, message):
    with pytest.raises(ValueError) as err:
        load_planner(planner, parse_planner_config(config))
    assert str(err.value).startswith(message), str(err.value)


def test_vpipe_planner_refuses_a_bad_configuration_at_start():
    proc = run_vpipe("planner", "--connect", "tcp://127.0.0.1:5", "--planner", DEFAULT_PLANNER,
                     "--planner-config", '{"warmup_samples": 0}')
    assert proc.returncode == 2, proc.stderr
    assert "vpipe: error: planner config: warmup_samples must be >= 1, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr
