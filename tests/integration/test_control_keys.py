"""CURVE key files and configuration: written safely, read strictly, every mistake named at start-up."""

from __future__ import annotations

import os
import stat

import pytest
import zmq
import zmq.auth

from vpipe.cli import main
from vpipe.control.curve import PUBLIC_ENV, SECRET_ENV, CurveConfig, RunKeys
from vpipe.control.keys import (
    KeyFileError,
    public_keys_from,
    read_public_file,
    read_secret_file,
    write_keypair,
)
from vpipe.settings import Settings


def curve_from_env(environ):
    """The CURVE configuration the settings ``environ`` sets make (as attach's keys make it)."""
    return RunKeys(Settings.read(environ)).curve()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_write_keypair_uses_zmq_certificate_format_and_safe_modes(tmp_path):
    public_path, secret_path = write_keypair(tmp_path / "keys", "host-a")
    assert (public_path.name, secret_path.name) == ("host-a.key", "host-a.key_secret")
    assert mode(secret_path) == 0o600 and mode(public_path) == 0o644
    public, secret = zmq.auth.load_certificate(secret_path)  # zmq's own reader agrees
    assert zmq.auth.load_certificate(public_path) == (public, None)
    assert zmq.curve_public(secret) == public
    assert read_secret_file(secret_path) == (public, secret)
    assert read_public_file(public_path) == public
    with pytest.raises(KeyFileError, match="host-a.key_secret exists; vpipe keys never overwrites"):
        write_keypair(tmp_path / "keys", "host-a")
    assert read_secret_file(secret_path) == (public, secret)  # untouched
    with pytest.raises(ValueError, match="a key name must be"):
        write_keypair(tmp_path, "../evil")


def test_vpipe_keys_cli_writes_a_pair(tmp_path, capsys):
    assert main(["keys", str(tmp_path), "--name", "node0"]) == 0
    out = capsys.readouterr().out
    public = read_public_file(tmp_path / "node0.key")
    assert f"({public.decode()})" in out
    assert f"export {SECRET_ENV}={tmp_path / 'node0.key_secret'}" in out
    assert mode(tmp_path / "node0.key_secret") == 0o600
    assert main(["keys", str(tmp_path), "--name", "node0"]) == 2
    assert "never overwrites a key file" in capsys.readouterr().err
    assert read_public_file(tmp_path / "node0.key") == public


def test_zmq_certificates_and_bare_z85_files_are_accepted(tmp_path):
    zpub_file, zsec_file = zmq.auth.create_certificates(tmp_path, "z")  # zmq writes the secret 0644 ...
    with pytest.raises(KeyFileError, match=r"z.key_secret is accessible by group or others \(mode 0644\); "
                                           r"run: chmod 600"):
        read_secret_file(zsec_file)
    os.chmod(zsec_file, 0o600)  # ... which vpipe refuses until it is private
    zpub, zsec = zmq.auth.load_certificate(zsec_file)
    assert read_secret_file(zsec_file) == (zpub, zsec)
    bare_public, bare_secret = zmq.curve_keypair()
    (tmp_path / "bare.pub").write_bytes(bare_public + b"\n")
    secret_file = tmp_path / "bare.secret"
    secret_file.write_bytes(b"# a comment\n" + bare_secret + b"\n")
    os.chmod(secret_file, 0o600)
    assert read_secret_file(secret_file) == (bare_public, bare_secret)  # the public key is derived
    assert read_public_file(tmp_path / "bare.pub") == bare_public
    assert public_keys_from([str(tmp_path)]) == {zpub: tmp_path / "z.key"}  # a directory: its *.key files
    assert set(public_keys_from([str(tmp_path / "bare.pub"), zpub_file])) == {bare_public, zpub}


@pytest.fixture
def pair(tmp_path):
    return write_keypair(tmp_path, "me")


def env(secret=None, public=None) -> dict[str, str]:
    out = {}
    if secret is not None:
        out[SECRET_ENV] = str(secret)
    if public is not None:
        out[PUBLIC_ENV] = public if isinstance(public, str) else os.pathsep.join(map(str, public))
    return out


def test_curve_is_off_unless_configured_and_both_variables_are_needed(pair):
    public_path, secret_path = pair
    assert curve_from_env({}) is None
    assert curve_from_env({SECRET_ENV: " ", PUBLIC_ENV: ""}) is None
    with pytest.raises(KeyFileError, match=f"{PUBLIC_ENV} is set but {SECRET_ENV} is not"):
        curve_from_env(env(public=[public_path]))
    with pytest.raises(KeyFileError, match=f"{SECRET_ENV} is set but {PUBLIC_ENV} is not"):
        curve_from_env(env(secret=secret_path))


def test_configuration_trusts_the_listed_keys_and_its_own(pair, tmp_path):
    public_path, secret_path = pair
    other_public, _ = write_keypair(tmp_path / "others", "b")
    third_public, _ = write_keypair(tmp_path / "others", "c")
    config = curve_from_env(env(secret_path, [tmp_path / "others"]))
    assert isinstance(config, CurveConfig)
    assert config.public == read_public_file(public_path)
    assert config.trusted == {config.public, read_public_file(other_public), read_public_file(third_public)}
    assert config.check_server_key(read_public_file(other_public), "rank 1") == read_public_file(other_public)
    stranger, _ = zmq.curve_keypair()
    with pytest.raises(ValueError, match="rank 3 presents CURVE key .* not among the trusted keys"):
        config.check_server_key(stranger, "rank 3")
    with pytest.raises(ValueError, match="rank 2 published no CURVE key"):
        config.check_server_key(None, "rank 2")


@pytest.mark.parametrize("content, message", [
    (b"", "holds no key"),
    (b"\x00\xff binary", "holds no key"),
    (b"curve\n    public-key = \"short\"\n", "its public-key is not a 40-character Z85 key"),
    (b"public-key = \"" + b"a" * 40 + b"\"\npublic-key = \"" + b"b" * 40 + b"\"\n", "two public-key lines"),
    (b"x" * 70_000, "is over the 65536-byte limit"),
])
def test_malformed_public_key_files_are_named(tmp_path, content, message):
    bad = tmp_path / "bad.key"
    bad.write_bytes(content)
    with pytest.raises(KeyFileError, match=message) as info:
        curve_from_env(env(write_keypair(tmp_path, "me")[1], [bad]))
    assert str(bad) in str(info.value)


def test_wrong_secret_and_public_files_are_named(pair, tmp_path):
    public_path, secret_path = pair
    missing = tmp_path / "nope.key"
    with pytest.raises(KeyFileError, match=f"CURVE key file {missing} does not exist"):
        curve_from_env(env(secret_path, [missing]))
    with pytest.raises(KeyFileError, match=f"{public_path} has a public key only"):
        curve_from_env(env(public_path, [public_path]))
    with pytest.raises(KeyFileError, match=f"{secret_path} holds a secret key; list the public file"):
        curve_from_env(env(secret_path, [secret_path]))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(KeyFileError, match=f"directory {empty_dir} has no \\*.key files"):
        curve_from_env(env(secret_path, [empty_dir]))
    other_public, _ = zmq.curve_keypair()
    mismatched = tmp_path / "mismatch.key_secret"
    _, secret = zmq.auth.load_certificate(secret_path)
    mismatched.write_bytes(b'public-key = "' + other_public + b'"\nsecret-key = "' + secret + b'"\n')
    os.chmod(mismatched, 0o600)
    with pytest.raises(KeyFileError, match=f"{mismatched}: its public-key does not belong to its secret-key"):
        curve_from_env(env(mismatched, [public_path]))
    unreadable = tmp_path / "dir.key_secret"
    unreadable.mkdir()
    with pytest.raises(KeyFileError, match=f"CURVE key file {unreadable} is a directory, not a regular file"):
        curve_from_env(env(unreadable, [public_path]))
