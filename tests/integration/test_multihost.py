"""Two hosts made of network namespaces: a 2-stage run across them, launched by torchrun.

The test makes two namespaces joined by a veth pair, with addresses that exist only
inside them (10.231.7.1 and .2), and starts ``torchrun --nnodes 2 ... -m vpipe_lab train`` in
each (one rank per "host"; node 0's torchrun agent hosts the rendezvous store, as it does
on real hosts). It proves:

- the data plane works across hosts: the final parameters equal a single-process
  reference bit for bit;
- the control plane works across hosts: stats reach the planner daemon and its plans come
  back to both stages (the run's decisions log);
- the control plane listens on the rendezvous interface only: every listening socket of
  the ranks and the daemon, read with ``ss`` inside each namespace while the run goes on,
  is on that namespace's veth address (the inboxes at exactly the published endpoints);
  only torchrun's own store listens on all interfaces.

It runs once without keys (`VPIPE_CONTROL_AUTH=none`, the opt-out several hosts need) and once with CURVE
on (a key pair per host).
Skipped, with the reason, where namespaces cannot be made (not root, no ``ip``, no
CAP_NET_ADMIN).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from support.processes import ROOT, child_env
from support.results import assert_params_equal, load_run_params
from vpipe.control.curve import PUBLIC_ENV, SECRET_ENV
from vpipe.control.keys import write_keypair
from vpipe.log import read_log
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.reference import reference_flush

SUBNET = "10.231.7"
IFNAME = "vpeth0"  # the veth end's name inside each namespace (names are per namespace)
MASTER_PORT = 29500  # a fresh namespace has nothing listening
CFG = RunConfig(stages=2, steps=100, blocks=2, d_model=32, n_heads=2, seq_len=16, micro_batches=2,
                micro_batch_size=2, dropout=0.0, monitor_every=4)
MARKER = "support.control_planners:record_and_mark"


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str

    def run(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespace, *args], capture_output=True, text=True,
                              timeout=20, **kwargs)


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        raise OSError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    """Two namespaces joined by a veth pair; removed afterwards, whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    if shutil.which("ip") is None or shutil.which("ss") is None:
        pytest.skip("needs iproute2's `ip` and `ss`")
    tag = f"vp{os.getpid()}"  # unique per test run; interface names must stay under 16 characters
    made: list[str] = []
    try:
        try:
            for side in "ab":
                _ip("netns", "add", tag + side)
                made.append(tag + side)
            _ip("link", "add", tag + "a", "type", "veth", "peer", "name", tag + "b")
        except OSError as e:
            pytest.skip(f"cannot create network namespaces joined by veth here: {e}")
        pair = (Host(tag + "a", f"{SUBNET}.1"), Host(tag + "b", f"{SUBNET}.2"))
        for host, link in zip(pair, (tag + "a", tag + "b")):
            _ip("link", "set", link, "netns", host.namespace)
            _ip("-n", host.namespace, "link", "set", link, "name", IFNAME)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", IFNAME)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("-n", host.namespace, "link", "set", IFNAME, "up")
        yield pair
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", tag + "a"], capture_output=True, timeout=20)  # if never moved
        leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(ns in leftover.split() for ns in made), leftover


# ---------------------------------------------------------------- watching sockets
_SS_LINE = re.compile(r"^LISTEN\s+\d+\s+\d+\s+(\S+):(\d+)\s+\S+\s*(.*)$")


def listeners(host: Host) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket inside ``host``'s namespace."""
    proc = host.run("ss", "-ltnpH")
    found = set()
    for line in proc.stdout.splitlines():
        match = _SS_LINE.match(line.strip())
        if match is None:
            continue
        address, port, users = match.groups()
        for pid in re.findall(r"pid=(\d+)", users):
            found.add((address.strip("[]"), int(port), int(pid)))
    return found


@dataclass
class Watch:
    """Polls ``ss`` in every namespace while the run goes on; remembers who listened where."""

    hosts: tuple[Host, ...]
    agents: dict[str, int]  # namespace -> torchrun agent pid
    seen: dict[str, set[tuple[str, int, int]]] = field(default_factory=dict)
    family: dict[int, str] = field(default_factory=dict)  # pid -> "agent" | "vpipe"
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            for host in self.hosts:  # sockets first: whoever owns one is alive when its family is read
                self.seen.setdefault(host.namespace, set()).update(listeners(host))
                self._note_family(self.agents[host.namespace])
            self.stop.wait(0.3)

    def _note_family(self, agent: int) -> None:
        self.family[agent] = "agent"
        try:
            # ranks, and the daemon rank 1 starts
            for child in psutil.Process(agent).children(recursive=True):
                self.family[child.pid] = "vpipe"
        except psutil.NoSuchProcess:
            pass


# ---------------------------------------------------------------- the run
def launch(host: Host, node_rank: int, master: Host, env: dict[str, str], out: Path, log_file: Path,
           logs: Path) -> subprocess.Popen:
    argv = ["ip", "netns", "exec", host.namespace, sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
            "--master-addr", master.address, "--master-port", str(MASTER_PORT),
            "-m", "vpipe_lab", "train", "--stages", "2", "--steps", str(CFG.steps), "--blocks",
            str(CFG.blocks),
            "--d-model", str(CFG.d_model), "--n-heads", str(CFG.n_heads), "--seq-len", str(CFG.seq_len),
            "--micro-batches", str(CFG.micro_batches), "--micro-batch-size", str(CFG.micro_batch_size),
            "--dropout", "0", "--monitor-every", str(CFG.monitor_every), "--planner", MARKER,
            "--log-file", str(log_file), "--out-dir", str(out), "--no-progress"]
    output = open(logs / f"node{node_rank}.txt", "w")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
    output.close()
    return proc


def host_env(tmp_path: Path, host: Host, curve: bool) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", str(ROOT))])
    env = child_env(PYTHONPATH=path, VPIPE_TEST_PLANNER_OUT=str(tmp_path / "planner.jsonl"),
                    GLOO_SOCKET_IFNAME=IFNAME)  # gloo's interface, as on real hosts with several
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "VPIPE_CONTROL_HOST", SECRET_ENV,
                 PUBLIC_ENV):
        env.pop(name, None)
    if not curve:  # as deployed without keys: several hosts need the explicit opt-out
        env["VPIPE_CONTROL_AUTH"] = "none"
    if curve:  # a key pair per host; every host trusts every host's public key
        keys = tmp_path / "keys"
        secret = keys / f"{host.namespace}.key_secret"
        env[SECRET_ENV] = str(secret)
        env[PUBLIC_ENV] = str(keys / "public")
    return env


def make_keys(tmp_path: Path, pair: tuple[Host, Host]) -> None:
    keys = tmp_path / "keys"
    for host in pair:
        public, _ = write_keypair(keys, host.namespace)
        (keys / "public").mkdir(exist_ok=True)
        shutil.copy(public, keys / "public" / public.name)


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_two_hosts_train_plan_and_listen_only_on_the_rendezvous_interface(hosts, tmp_path, curve):
    a, b = hosts
    if curve:
        make_keys(tmp_path, hosts)
    out, log_file, logs = tmp_path / "out", tmp_path / "run.log", tmp_path
    procs = {a.namespace: launch(a, 0, a, host_env(tmp_path, a, curve), out, log_file, logs),
             b.namespace: launch(b, 1, a, host_env(tmp_path, b, curve), out, log_file, logs)}
    watch = Watch(hosts, {ns: p.pid for ns, p in procs.items()})
    watcher = threading.Thread(target=watch.run, daemon=True)
    watcher.start()
    try:
        codes = {ns: p.wait(timeout=240) for ns, p in procs.items()}
    finally:
        watch.stop.set()
        watcher.join(timeout=10)
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    output = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(logs.glob("node*.txt")))
    assert codes == {a.namespace: 0, b.namespace: 0}, output

    # the data plane: parameters equal the single-process reference, bit for bit
    assert_params_equal(load_run_params(out, 2), reference_flush(CFG)[0])

    # the control plane: stats reached the planner, its plans came back to both stages
    records = read_log(log_file)
    vectors = [json.loads(line) for line in (tmp_path / "planner.jsonl").read_text().splitlines()]
    iterations = [v["iteration"] for v in vectors]
    assert iterations and iterations == sorted(set(iterations)), iterations
    assert iterations[-1] == CFG.steps - 1  # the last sampled step is drained at the end
    assert all(it % CFG.monitor_every == CFG.monitor_every - 1 for it in iterations)
    assert all([r["stage"] for r in v["records"]] == [0, 1] for v in vectors)
    sent = [r for r in records if r.get("event") == "plan_sent"]
    assert len(sent) == len(vectors)  # the marker planner answers every vector
    assert not [r["msg"] for r in records if "refused" in r["msg"]]  # every handshake succeeded
    for rank in (0, 1):
        got = [r for r in records if r.get("event") == "plan_received" and r.get("rank") == rank]
        assert got and all(r["reason"].startswith("marker ") for r in got), f"rank {rank} received no plan"

    # where the control sockets listen: the published endpoints, on the veth address, nothing wider
    inboxes = {r["rank"]: r for r in records if "control_endpoint" in r}
    assert set(inboxes) == {0, 1, None}  # the two ranks and the daemon (rank None)
    expected = {0: a, 1: b, None: b}
    for rank, r in inboxes.items():
        host = expected[rank]
        assert r["bind"] == host.address and r["curve"] is curve
        assert re.fullmatch(rf"tcp://{re.escape(host.address)}:\d+", r["control_endpoint"]), r
    for host in hosts:
        seen = watch.seen[host.namespace]
        vpipe_sockets = {(addr, port) for addr, port, pid in seen if watch.family.get(pid) == "vpipe"}
        mine = {int(r["control_endpoint"].rsplit(":", 1)[1]) for rank, r in inboxes.items()
                if expected[rank] == host}
        assert {(host.address, port) for port in mine} <= vpipe_sockets, (host, seen)
        # every socket the ranks and the daemon listen on (control inboxes, gloo) is on the veth address
        assert {addr for addr, _ in vpipe_sockets} == {host.address}, (host, seen)
        # only torchrun's agent, hosting the store on node 0, listens on all interfaces
        others = {(addr, port, watch.family.get(pid)) for addr, port, pid in seen
                  if watch.family.get(pid) != "vpipe"}
        assert others == ({("*", MASTER_PORT, "agent")} if host is a else set()), others
