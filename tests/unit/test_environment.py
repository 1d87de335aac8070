"""Every VPIPE_* variable is checked where vpipe starts: one line naming the variable, its value and what is
allowed, instead of a traceback on every rank (or a nan accepted as a timeout)."""

from __future__ import annotations

import pytest

from vpipe.rank.environment import SettingError, check_environment

BAD = [
    ("VPIPE_PLANNER_TIMEOUT", "abc", "expected a number of seconds above 0 and at most 604800"),
    ("VPIPE_PLANNER_TIMEOUT", "nan", "expected a number of seconds above 0 and at most 604800"),
    ("VPIPE_MIGRATION_TIMEOUT", "-1", "expected a number of seconds above 0 and at most 604800"),
    ("VPIPE_AGREE_TIMEOUT", "inf", "expected a number of seconds above 0 and at most 604800"),
    ("VPIPE_TRACE_STEPS", "garbage", "expected START,COUNT: the first step to record and how many"),
    ("VPIPE_TRACE_STEPS", "3,0", "expected START,COUNT"),
    ("VPIPE_METRICS", "bogus", "metrics must name tensorboard and/or wandb (comma-separated), got 'bogus'"),
    ("VPIPE_FAULTS", "kill@x:y", "bad entry 'kill@x:y'; expected kill@STEP:RANK"),
    ("VPIPE_PREFETCH_ALLOC", "zzz", "expected one of copy, compute"),
    ("VPIPE_CONTROL_AUTH", "maybe", "expected one of auto, required, none"),
    ("VPIPE_CONTROL_HOST", "8.8.8.8", "expected an IP address of this host (or 0.0.0.0 for every interface)"),
    ("VPIPE_CONTROL_HOST", "not-an-address", "expected an IP address of this host"),
]


@pytest.mark.parametrize("name, value, allowed", BAD)
def test_a_bad_value_is_one_line_naming_variable_value_and_what_is_allowed(name, value, allowed):
    with pytest.raises(SettingError) as caught:
        check_environment({name: value})
    message = str(caught.value)
    assert message.startswith(f"{name}={value!r}: ") and allowed in message and "\n" not in message


def test_a_metrics_directory_that_is_a_file_is_named(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("")
    with pytest.raises(SettingError,
                       match=f"VPIPE_METRICS_DIR='{afile}': the metrics directory {afile} is a file"):
        check_environment({"VPIPE_METRICS_DIR": str(afile)})


def test_good_values_and_unset_or_empty_variables_pass(tmp_path):
    check_environment({"VPIPE_PLANNER_TIMEOUT": "2.5", "VPIPE_TRACE_STEPS": "3,2",
                       "VPIPE_METRICS": "tensorboard",
                       "VPIPE_FAULTS": "kill@5:1", "VPIPE_PREFETCH_ALLOC": "compute",
                       "VPIPE_CONTROL_AUTH": "none",
                       "VPIPE_CONTROL_HOST": "127.0.0.1", "VPIPE_METRICS_DIR": str(tmp_path / "m"),
                       "VPIPE_AGREE_TIMEOUT": ""})
    check_environment({})


@pytest.mark.parametrize("name, value, allowed", [BAD[0], BAD[3], BAD[10]])
def test_vpipe_train_stops_before_any_rank_with_that_line_and_exit_2(monkeypatch, capsys, name, value,
                                                                     allowed):
    from vpipe_lab.cli import main

    monkeypatch.setenv(name, value)
    assert main(["train", "--steps", "1", "--vpipe", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"vpipe: error: {name}={value!r}: {allowed}"  # one line, nothing else
