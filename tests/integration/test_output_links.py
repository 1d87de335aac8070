"""Links planted where a command writes: at every output file of every
command, and on the way to every directory.

Each test plants what another user could: a symbolic link at the name vpipe writes, or a link in
place of a directory vpipe writes in, in a directory other users can change (``0777``, not sticky)
or made by another user (``lchown`` to a uid that is not ours). The link's target must be
unchanged, and the command must say so in one line and exit 2, before it writes anything. Before:
``vpipe nas --out-dir`` (nas.json), ``vpipe plan --model
--save-graph``, ``LayerGraph.save``, ``vpipe bench --json``, ``vpipe plot -o`` and ``vpipe trace --png`` wrote
through the link, and every directory link was followed (files made in the other user's directory).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.graphs import chain
from support.plan_cli import MODELS
from support.run_logs import plotted_log
from vpipe import timeline

PRECIOUS = "another user's file, which vpipe must not touch\n"
SHARED = "a symbolic link in a directory other users can change"
FOREIGN = "a symbolic link another user made (uid 4242)"
TINY = ["--blocks", "2", "--d-model", "16", "--seq-len", "8", "--no-progress"]


@pytest.fixture
def place(tmp_path):
    """Where a test plants: ``shared`` (0777) and the victim's file
    and directory, whose contents must stay."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (tmp_path / "victim").write_text(PRECIOUS)
    (tmp_path / "victim-dir").mkdir()
    return tmp_path


def plant(link: Path, target: Path, *, foreign: bool = False) -> str:
    """A link at ``link`` to ``target``; ``foreign``: made by another user (uid 4242). What vpipe calls it."""
    link.symlink_to(target)
    if foreign:
        os.lchown(link, 4242, 4242)
    return FOREIGN if foreign else SHARED


def untouched(tmp_path: Path) -> None:
    assert (tmp_path / "victim").read_text() == PRECIOUS
    assert list((tmp_path / "victim-dir").iterdir()) == []


def one_line(argv: list[str], capsys) -> str:
    from vpipe_lab.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _run_dir(tmp_path: Path) -> Path:
    timeline.start(0, tmp_path / "run", [0])
    with timeline.span("vpipe.forward", timeline.COMPUTE, 0, micro_batch=0):
        pass
    timeline.stop()
    return tmp_path / "run"


def _fake_benchmarks(tmp_path: Path, monkeypatch) -> None:
    from vpipe_lab import bench

    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    (scripts / "fake.py").write_text("import argparse, json\np = "
                                     "argparse.ArgumentParser()\np.add_argument('--json')\n"
                                     "json.dump({'value': 42}, open(p.parse_args().json, 'w'))\n")
    monkeypatch.setattr(bench, "default_benchmarks_dir", lambda: scripts)
    monkeypatch.setattr(bench, "BENCHMARKS", {"fake": bench.Benchmark("fake", "fake.py", "a fake")})


# (command line, the output it writes, what the error calls it): every output file of every command
COMMANDS = {
    "trace -o": (["trace", "<run>", "-o", "<out>"], "trace.json", "-o"),
    "trace --png": (["trace", "<run>", "-o", "<private>/t.json", "--png", "<out>"], "t.png", "--png"),
    "plot -o": (["plot", "<log>", "-o", "<out>"], "p.png", "-o"),
    "bench --json FILE": (["bench", "fake", "--json", "<out>"], "fake-out.json", "--json"),
    "bench --json DIR (NAME.json)": (["bench", "--json", "<shared>"], "fake.json", "--json"),
    "bench --json DIR (bench.json)": (["bench", "--json", "<shared>"], "bench.json", "--json"),
    "plan --save-graph": (["plan", "--model", f"{MODELS}:encoder_decoder", "--repeats", "1", "--stages", "2",
                           "--save-graph", "<out>"], "g.json", "--save-graph"),
    "train --log-file": (["train", "--steps", "1", "--log-file", "<out>"], "run.log", "log file"),
    "nas --log-file": (["nas", "--log-file", "<out>"], "run.log", "log file"),
}
# the files the ranks of `vpipe train` / `vpipe nas` write in --out-dir, checked before any rank starts
OUT_DIR = [("train", "rank0.pt"), ("train", "rank1.json"), ("nas", "nas.json")]


@pytest.mark.parametrize("foreign", [False, True], ids=["shared-directory", "another-users-link"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_link_at_any_output_file_of_a_command_is_refused_in_one_line(place, capsys, monkeypatch, command,
                                                                       foreign):
    argv, name, what = COMMANDS[command]
    holder = place / "shared" if not foreign else place / "mine"
    holder.mkdir(exist_ok=True)
    _fake_benchmarks(place, monkeypatch)
    (place / "private").mkdir()
    out = holder / name
    reason = plant(out, place / "victim", foreign=foreign)
    swap = {"<run>": str(_run_dir(place)), "<log>": str(plotted_log(place / "run.log", steps=4)),
            "<out>": str(out),
            "<shared>": str(holder), "<private>": str(place / "private")}
    argv = [swap.get(a, a.replace("<private>", str(place / "private"))) for a in argv]
    said = one_line(argv, capsys)
    prefix = "vpipe plot: " if argv[0] == "plot" else "vpipe: error: "
    assert (
        said
        == f"{prefix}{what} {out} is {reason}; vpipe does not write through it: "
        "remove it, or name another file"
    )
    untouched(place)


@pytest.mark.parametrize("command, name", OUT_DIR)
def test_a_link_at_a_file_the_ranks_write_in_out_dir_is_refused_before_any_rank_starts(place, capsys, command,
                                                                                       name):
    out = place / "shared"
    reason = plant(out / name, place / "victim")
    assert one_line([command, *TINY, "--steps", "1", "--out-dir", str(out)], capsys) == (
        f"vpipe: error: out_dir {out}: {out / name} is {reason}; vpipe does not write through "
        "it: remove it, or give this run a directory of its own")
    untouched(place)


def test_layer_graph_save_never_writes_through_a_planted_link(place):
    from vpipe.files import PlantedLinkError
    from vpipe.graph import LayerGraph

    graph = chain([1.0, 2.0])
    reason = plant(place / "shared" / "g.json", place / "victim")
    with pytest.raises(PlantedLinkError, match=f"^graph file {place / 'shared' / 'g.json'} is {reason}; "):
        graph.save(place / "shared" / "g.json")
    untouched(place)
    graph.save(place / "g.json")  # a plain name: written, this user's alone
    assert LayerGraph.load(place / "g.json").to_dict() == graph.to_dict()
    assert os.stat(place / "g.json").st_mode & 0o777 == 0o600


# ---------------------------------------------------------------------- directory links
DIRECTORIES = {  # how a run is given the directory, and what its one line calls it
    "--out-dir": (["--out-dir", "<dir>"], {}, "out_dir"),
    "--checkpoint-dir": (["--checkpoint-dir", "<dir>"], {}, "checkpoint_dir"),
    "--log-file's directory": (["--log-file", "<dir>/run.log"], {}, "log file"),
    "VPIPE_TRACE_DIR": (["--vpipe"], {"VPIPE_TRACE_DIR": "<dir>", "VPIPE_TRACE_STEPS": "1,1"},
                        "VPIPE_TRACE_DIR"),
    "VPIPE_METRICS_DIR": (["--vpipe"], {"VPIPE_METRICS_DIR": "<dir>", "VPIPE_METRICS": "tensorboard"},
                          "VPIPE_METRICS_DIR"),
}


@pytest.mark.parametrize("foreign", [False, True], ids=["shared-directory", "another-users-link"])
@pytest.mark.parametrize("given", DIRECTORIES)
def test_a_directory_that_is_a_planted_link_is_refused_before_any_rank_starts(place, capsys, monkeypatch,
                                                                              given,
                                                                             foreign):
    flags, env, what = DIRECTORIES[given]
    holder = place / ("shared" if not foreign else "mine")
    holder.mkdir(exist_ok=True)
    link = holder / "outputs"
    reason = plant(link, place / "victim-dir", foreign=foreign)
    for name, value in env.items():
        monkeypatch.setenv(name, value.replace("<dir>", str(link)))
    argv = ["train", *TINY, "--steps", "1", *[f.replace("<dir>", str(link)) for f in flags]]
    named = f"{link}/run.log: {link}" if given.startswith("--log-file") else str(link)
    fix = "remove it, or name another directory"
    assert (
        one_line(argv, capsys)
        == f"vpipe: error: {what} {named} is {reason}; vpipe does not write through it: {fix}"
    )
    untouched(place)


def test_the_library_never_makes_a_file_through_a_directory_link(place, tmp_path):
    """Where the ranks write later (a link planted after the run started): the timeline, a
    checkpoint, a run log, the metrics' directory and an attach-given trace_dir are
    refused, and nothing lands in the other user's directory."""
    import torch

    from vpipe.checkpoint import save_checkpoint
    from vpipe.files import FileCheckError, PlantedLinkError
    from vpipe.log import RunLog
    from vpipe.rank.tracing import TraceWindow

    link = place / "shared" / "out"
    reason = plant(link, place / "victim-dir")
    refusal = f"{link} is {reason}; vpipe does not write through it"
    with pytest.raises(OSError, match=refusal):  # the trace window says it and training goes on
        timeline.start(0, link / "trace", [0])
        timeline.stop()
    with pytest.raises(ValueError, match=f"^trace_dir {link} is {reason}"):  # at attach, as metrics_dir is
        TraceWindow((2, 1), link, rank=0, stages=[0])
    with pytest.raises(FileCheckError, match=refusal):
        RunLog(link / "run.log", rank=0)

    class Store(dict):
        def set(self, key, value):
            self[key] = value.encode()

        def multi_get(self, keys):
            return [self[k] for k in keys]

    with pytest.raises(PlantedLinkError, match=refusal):  # an OSError too: "cannot write the checkpoint ..."
        save_checkpoint(link, 1, module=torch.nn.Sequential(torch.nn.Linear(2, 2)), optimizer=None, rank=0,
                        world_size=1, store=Store(), vpipe_state={"version": 1, "epoch": 0, "iteration": 1,
                                                                  "stages": [[0]], "policies": {},
                                                                  "next_layer_id": 1})
    if _has("tensorboard"):
        from vpipe.rank.metrics import MetricsWriter

        with pytest.raises(ValueError, match=f"^metrics_dir {link} is {reason}"):
            MetricsWriter(("tensorboard",), link, rank=0)
    untouched(place)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
