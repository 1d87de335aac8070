"""Every VPIPE_* variable is read in one place, into one value, once per process."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import zmq

import vpipe
from vpipe.config import VpipeConfig
from vpipe.control.curve import RUN_SECRET_ENV, RunKeys
from vpipe.control.netaddr import control_host
from vpipe.faults import Faults
from vpipe.rank.environment import check_environment
from vpipe.settings import VARIABLES, SettingError, Settings, process_settings

ROOT = Path(__file__).resolve().parents[2]

EVERY = {"VPIPE_PLANNER_TIMEOUT": "2.5", "VPIPE_MIGRATION_TIMEOUT": "7", "VPIPE_AGREE_TIMEOUT": "9",
         "VPIPE_LOG_FILE": "run.log", "VPIPE_TRACE_STEPS": "3,2", "VPIPE_TRACE_DIR": "t",
         "VPIPE_METRICS": "tensorboard", "VPIPE_METRICS_DIR": "m",
         "VPIPE_FAULTS": "kill@5:1, migration_silent@0",
         "VPIPE_PREFETCH_ALLOC": "compute", "VPIPE_CONTROL_AUTH": " none ", "VPIPE_CONTROL_HOST": "127.0.0.1",
         "VPIPE_CURVE_SECRET_FILE": " s.key_secret", "VPIPE_CURVE_PUBLIC_KEYS": f"a{os.pathsep}b",
         "VPIPE_CURVE_RUN_SECRET": "x", "VPIPE_CURVE_RUN_SECRET_FILE": "f"}


def test_every_variable_the_library_names_is_a_field_of_the_settings():
    named = {m for path in (ROOT / "vpipe").rglob("*.py")
             for m in re.findall(r"VPIPE_[A-Z_]+", path.read_text())}
    assert named == set(VARIABLES) == set(EVERY) and len(VARIABLES) == 16


def test_each_variable_is_parsed_into_its_field():
    settings = Settings.read(EVERY)
    assert (settings.planner_timeout_s, settings.migration_timeout_s, settings.agree_timeout_s) == (2.5, 7.0,
                                                                                                    9.0)
    assert (settings.log_file, settings.trace_steps, settings.trace_dir) == ("run.log", (3, 2), "t")
    assert (settings.metrics, settings.metrics_dir, settings.prefetch_alloc) == ("tensorboard", "m",
                                                                                 "compute")
    assert (
        settings.faults == Faults.parse("migration_silent@0,kill@5:1") and settings.faults.kill_step(1) == 5
    )
    assert (settings.control_auth, settings.control_host) == ("none", "127.0.0.1")
    assert (settings.curve_secret_file, settings.curve_public_keys) == ("s.key_secret", ("a", "b"))
    assert (settings.curve_run_secret, settings.curve_run_secret_file) == ("x", "f")


def test_unset_and_empty_variables_are_the_defaults():
    assert Settings.read({}) == Settings.read({name: "" for name in VARIABLES}) == Settings()
    assert Settings().faults == Faults() and not Settings().faults.active("migration_die", 0)
    assert (Settings().planner_timeout_s, Settings().agree_timeout_s, Settings().trace_dir) == (5.0, 120.0,
                                                                                              "vpipe-trace")


@pytest.mark.parametrize("name, value, reason", [
    ("VPIPE_AGREE_TIMEOUT", "inf", "expected a number of seconds above 0 and at most 604800"),
    ("VPIPE_TRACE_STEPS", "5", "expected START,COUNT"),
    ("VPIPE_FAULTS", "explode@1", "bad entry 'explode@1'"),
    ("VPIPE_CONTROL_HOST", "999.1.1.1", "expected an IP address of this host"),
])
def test_a_value_vpipe_cannot_use_is_one_line_naming_the_variable(name, value, reason):
    with pytest.raises(SettingError) as caught:
        Settings.read({name: value})
    assert str(caught.value).startswith(f"{name}={value!r}: ") and reason in str(caught.value)


def test_a_config_made_at_attach_takes_its_defaults_from_the_settings_read_there(monkeypatch):
    monkeypatch.setenv("VPIPE_LOG_FILE", "from-the-environment.log")
    settings = Settings.read({"VPIPE_TRACE_STEPS": "1,2", "VPIPE_AGREE_TIMEOUT": "3"})
    config = VpipeConfig.from_settings(settings, sample_every=4, trace_dir="mine")
    assert (config.log_file, config.trace_steps, config.agree_timeout_s) == (None, (1, 2), 3.0)
    assert (config.sample_every, config.trace_dir) == (4, "mine")  # what the caller sets wins
    # a config made by hand: the process's settings
    assert VpipeConfig().log_file == "from-the-environment.log"
    assert (process_settings().log_file, process_settings().trace_dir) == ("from-the-environment.log",
                                                                           "vpipe-trace")


def test_the_process_reads_its_settings_once_and_a_later_change_changes_nothing(monkeypatch):
    reads = []
    real = Settings.read.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(Settings, "read", classmethod(lambda cls, environ: reads.append(1)
                                                      or real(cls, environ)))
    monkeypatch.setenv("VPIPE_LOG_FILE", "first.log")
    monkeypatch.setenv("VPIPE_CONTROL_HOST", "127.0.0.1")
    first = VpipeConfig()
    monkeypatch.setenv("VPIPE_LOG_FILE", "second.log")  # after the first read: too late for this process
    monkeypatch.setenv("VPIPE_CONTROL_HOST", "0.0.0.0")
    assert first.log_file == VpipeConfig().log_file == check_environment().log_file == "first.log"
    assert control_host(master_addr="127.0.0.1") == ("127.0.0.1", "127.0.0.1")  # not the wildcard set later
    assert process_settings() is check_environment() and len(reads) == 1
    process_settings.cache_clear()  # what a new process would read
    assert VpipeConfig().log_file == "second.log" and len(reads) == 2


def test_a_bad_value_is_not_kept_so_the_next_ask_reads_again(monkeypatch):
    monkeypatch.setenv("VPIPE_AGREE_TIMEOUT", "-1")
    with pytest.raises(SettingError, match="VPIPE_AGREE_TIMEOUT='-1'"):
        VpipeConfig()
    monkeypatch.setenv("VPIPE_AGREE_TIMEOUT", "7")
    assert VpipeConfig().agree_timeout_s == 7.0


def test_the_configuration_has_its_own_home_and_its_old_import_path_works():
    from vpipe._attach import VpipeConfig as from_attach
    from vpipe.rank.config import VpipeConfig as old_path

    assert (
        vpipe.VpipeConfig is from_attach is old_path is VpipeConfig
        and VpipeConfig.__module__ == "vpipe.config"
    )


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE")
def test_two_attaches_keys_are_their_own_and_the_environment_is_left_alone(monkeypatch):
    monkeypatch.delenv(RUN_SECRET_ENV, raising=False)
    first, second = RunKeys(Settings()), RunKeys(Settings())
    first.agree(zmq.curve_keypair()[1].decode())
    assert first.curve() is not None and second.curve() is None and RUN_SECRET_ENV not in os.environ
    assert first.child_env() == {RUN_SECRET_ENV: first.secret} and second.child_env() == {}
    second.agree(zmq.curve_keypair()[1].decode())
    files = first.secret_file(), second.secret_file()
    assert files[0] != files[1] and first.secret_file() == files[0]  # made once per owner
    second.close()
    assert os.path.exists(files[0]) and not os.path.exists(files[1])  # the other attach's file stays
    first.close()
    assert not os.path.exists(files[0])
    given = RunKeys(Settings(curve_run_secret_file="/given/by/the/user"))
    assert given.given and given.secret_file() == "/given/by/the/user" and given.child_env() == {}
