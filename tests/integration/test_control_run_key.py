"""The run's control-plane key under torchrun: it never transits the rendezvous store.

torchrun's store answers anyone who connects. An intruder here connects to it while a real
2-rank ``torchrun ... -m vpipe_lab train --vpipe`` runs, reads every key vpipe writes there
(endpoints, public keys, the attach namespace, the old ``ctl/run-secret`` and the new key
file's path, whose file it then tries to open), and uses whatever secret it found to say
``hello`` and send a plan to the last stage. Its handshake must fail, the refusal must be
logged, and the run must end exactly where the single-process reference does.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from support.control_runs import decisions, planner_env
from support.processes import ROOT, wait_while_running
from support.results import assert_params_equal, load_run_params
from vpipe.control.curve import RUN_SECRET_ENV, RUN_SECRET_FILE_ENV, RunKeys
from vpipe.control.keys import KeyFileError
from vpipe.control.messages import PLANNER, encode, make
from vpipe.control.run_key import AUTH_ENV, agree_run_key, read_private_key
from vpipe.log import read_log
from vpipe.plan import Plan
from vpipe.settings import Settings
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.reference import reference_flush

CFG = RunConfig(stages=2, steps=300, blocks=2, d_model=16, n_heads=2, seq_len=8, micro_batches=2,
                micro_batch_size=2, dropout=0.0, monitor_every=4)
INTRUDER_PID = 4242
KEYS = ("vpipe/ctl/planner", "vpipe/ctl/ep/0", "vpipe/ctl/ep/1", "vpipe/ctl/key/0", "vpipe/ctl/key/1",
        "ctl/run-secret", "ctl/run-key-file", "ctl/run-key-read/1", "ctl/run-key-gone", "layers/0",
        "layers/1")
INTRUDER_EPOCH = 500  # far above what the run's marker planner reaches in 300 steps, within the jump limit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Intruder:
    """A local process that is not one of the run's: it reads the store and tries the control plane."""

    def __init__(self, port: int) -> None:
        import torch.distributed as dist

        raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        # the ranks' default store: the process group's prefix over the store given to it, or over env://'s
        self.roots = [raw, dist.PrefixStore("0/", raw),
                      dist.PrefixStore("0/", dist.PrefixStore("default_pg", raw))]
        self.read: dict[str, bytes] = {}
        self.events: list[int] = []
        self.public = b""

    def read_everything(self) -> None:
        """Every key vpipe puts in the store (documented in docs/control-plane.md, and the old secret's)."""
        import torch.distributed as dist

        for root in self.roots:
            for store in (root, dist.PrefixStore("vpipe/attach-0/", root)):
                for key in KEYS:
                    if store.check([key]):
                        self.read[key] = store.get(key)

    def secret(self) -> bytes | None:
        """The run's secret, if anything in the store gives it away."""
        if self.read.get("ctl/run-secret"):
            return self.read["ctl/run-secret"]
        path = self.read.get("ctl/run-key-file", b"").decode()
        try:
            return read_private_key(path).encode() if path else None
        except KeyFileError:
            return None

    def attack(self, seconds: float) -> None:
        endpoint = self.read["vpipe/ctl/planner"].decode()
        server_key = self.read["vpipe/ctl/key/1"]
        secret = self.secret() or zmq.curve_keypair()[1]
        self.public = zmq.curve_public(secret)
        context = zmq.Context()
        try:
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            push.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
            push.setsockopt(zmq.CURVE_SECRETKEY, secret)
            monitor = push.get_monitor_socket()
            push.connect(endpoint)
            hello = make("hello", {"pid": INTRUDER_PID, "endpoint": "tcp://127.0.0.1:9"}, stage=PLANNER)
            plan = make("plan", Plan(epoch=INTRUDER_EPOCH, stages=((0, 1), (2, 3))), epoch=INTRUDER_EPOCH,
                        stage=PLANNER)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                for message in (hello, plan):
                    try:
                        push.send(encode(message), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                while monitor.poll(0):
                    self.events.append(recv_monitor_message(monitor)["event"])
                time.sleep(0.05)
        finally:
            context.destroy(linger=0)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_store_reader_cannot_pass_the_control_planes_authentication(tmp_path):
    port, out, log_file = _free_port(), tmp_path / "out", tmp_path / "run.log"
    env = planner_env(tmp_path / "planner.jsonl")
    for name in (RUN_SECRET_ENV, RUN_SECRET_FILE_ENV, "VPIPE_CURVE_SECRET_FILE", "VPIPE_CURVE_PUBLIC_KEYS"):
        env.pop(name, None)
    run = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "vpipe_lab", "train", "--vpipe",
         "--planner", "support.control_planners:record_and_mark", "--stages", "2", "--steps", str(CFG.steps),
         "--blocks", str(CFG.blocks), "--d-model", str(CFG.d_model), "--n-heads", str(CFG.n_heads),
         "--seq-len", str(CFG.seq_len), "--micro-batches", str(CFG.micro_batches), "--micro-batch-size",
         str(CFG.micro_batch_size), "--dropout", "0", "--monitor-every", str(CFG.monitor_every),
         "--log-file", str(log_file), "--out-dir", str(out), "--no-progress"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_while_running(lambda: _listening(port), 60, "torchrun's store", run)
        intruder = Intruder(port)

        def ready() -> bool:
            intruder.read_everything()
            return "vpipe/ctl/key/1" in intruder.read and "vpipe/ctl/planner" in intruder.read

        wait_while_running(ready, 120, "the last stage's key and endpoint in the store", run)
        intruder.read_everything()
        intruder.attack(seconds=2.0)
        output, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, output[-3000:]
    # no secret in it ...
    assert "ctl/run-secret" not in intruder.read and "ctl/run-key-file" in intruder.read
    assert intruder.secret() is None  # ... nor reachable from it
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in intruder.events
    assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in intruder.events  # the run's ZAP handler refused its key
    records = read_log(log_file)
    refused = [r["msg"] for r in records if "refused a CURVE client" in r["msg"]]
    assert refused and intruder.public.decode() in refused[0]  # logged, with the key
    assert not [r for r in decisions(log_file, "planner_attached") if r.get("pid") == INTRUDER_PID]
    assert not [r for r in decisions(log_file, "plan_received") if r.get("epoch") == INTRUDER_EPOCH]
    assert [r for r in decisions(log_file, "plan_received")]  # the run's own planner got through
    assert_params_equal(load_run_params(out, 2), reference_flush(CFG)[0])
    key_file = intruder.read["ctl/run-key-file"].decode()
    assert not os.path.exists(os.path.dirname(key_file))  # gone once every rank had the key
    manual = [r["manual_command"] for r in records if "manual_command" in r]
    daemon_key = manual[0].split("=", 1)[1].split()[0]
    assert not os.path.exists(os.path.dirname(daemon_key))  # the manual daemon's key file: removed at exit


# ------------------------------------------------------------------ the private file, in one process
@pytest.fixture
def clean_env(monkeypatch):
    for name in (RUN_SECRET_ENV, RUN_SECRET_FILE_ENV, "VPIPE_CURVE_SECRET_FILE", "VPIPE_CURVE_PUBLIC_KEYS",
                 AUTH_ENV, "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        # set first, so that teardown restores the variable as it was even when the
        # code under test set it (the key it agrees on must not reach the later tests
        # of this process: their sockets would expect CURVE)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def _keys_now():
    """Keys of the environment as it is now, as a process started
    now reads it (this one read its settings once)."""
    return RunKeys(Settings.read(os.environ))


def _store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def test_two_ranks_share_a_key_through_a_private_file_that_is_gone_after(clean_env):
    store, got, errors = _store(), {}, []
    keys = {r: RunKeys(Settings()) for r in (0, 1)}  # each rank's attach's own

    def rank(r: int) -> None:
        try:
            got[r] = agree_run_key(store, rank=r, world_size=2, timeout_s=10, who=f"rank {r}", keys=keys[r])
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors and got == {0: "private-file", 1: "private-file"}
    secret = keys[0].secret
    # held by the attach, not the process
    assert keys[1].secret == secret and RUN_SECRET_ENV not in os.environ
    assert keys[0].curve() == keys[1].curve() is not None
    assert len(secret) == 40 and secret.encode() not in store.get("ctl/run-key-file")
    assert not os.path.exists(store.get("ctl/run-key-file").decode())


def test_a_key_file_that_is_not_private_or_not_this_users_is_refused(tmp_path):
    folder = tmp_path / "k"
    folder.mkdir(mode=0o700)
    key = folder / "control.key_secret"
    key.write_text(zmq.curve_keypair()[1].decode() + "\n")
    key.chmod(0o600)
    assert len(read_private_key(str(key))) == 40
    key.chmod(0o644)
    with pytest.raises(KeyFileError, match="is not private to this user .*mode 0644"):
        read_private_key(str(key))
    key.chmod(0o600)
    folder.chmod(0o755)
    with pytest.raises(KeyFileError, match="is not a private directory of this user"):
        read_private_key(str(key))
    folder.chmod(0o700)
    link = folder / "link"
    link.symlink_to(key)
    with pytest.raises(KeyFileError, match="cannot read run key file"):
        read_private_key(str(link))
    fifo = folder / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(KeyFileError, match="is a FIFO, not a regular file"):
        read_private_key(str(fifo))


def test_several_hosts_without_a_key_refuse_unless_told_to_run_unauthenticated(clean_env, caplog):
    """Two torchrun agents with --nnodes 2 used to run the control plane unauthenticated by default;
    another local user took over the planner link with a plain hello."""
    clean_env.setenv("LOCAL_WORLD_SIZE", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError,
                       match=f"would be unauthenticated .* and {AUTH_ENV}=auto; give every rank one "
                                           f"key .*, or set {AUTH_ENV}=none to run it unauthenticated"):
        agree_run_key(None, rank=1, world_size=2, timeout_s=1, who="rank 1")
    clean_env.setenv(AUTH_ENV, "none")
    with caplog.at_level("WARNING", logger="vpipe.control"):
        keyed = agree_run_key(None, rank=1, world_size=2, timeout_s=1, who="rank 1", keys=_keys_now())
    assert keyed == "unauthenticated"
    assert "THE CONTROL PLANE IS UNAUTHENTICATED (the run spans several hosts" in caplog.text
    assert RUN_SECRET_ENV not in os.environ
    clean_env.setenv(AUTH_ENV, "required")
    with pytest.raises(RuntimeError, match=f"would be unauthenticated .* and {AUTH_ENV}=required"):
        agree_run_key(None, rank=1, world_size=2, timeout_s=1, who="rank 1", keys=_keys_now())
    clean_env.setenv(AUTH_ENV, "yes")
    with pytest.raises(ValueError, match=f"{AUTH_ENV}='yes': expected one of auto, required, none"):
        agree_run_key(None, rank=1, world_size=2, timeout_s=1, who="rank 1", keys=_keys_now())
    clean_env.setenv(AUTH_ENV, "required")
    clean_env.setenv(RUN_SECRET_ENV, zmq.curve_keypair()[1].decode())  # a key the user gave: no warning
    assert agree_run_key(None, rank=1, world_size=2, timeout_s=1, who="rank 1",
                         keys=_keys_now()) == "configured"
