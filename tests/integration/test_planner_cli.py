"""``vpipe plan``: JSON and table output, and one-line errors with exit status 2 for bad input."""

from __future__ import annotations

import json
import re

import pytest

from support.graphs import chain
from support.processes import child_env, run_vpipe
from vpipe.cli import main
from vpipe.planner.cli import parse_bytes


def _run(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *args])
    except SystemExit as e:  # argparse errors exit through sys.exit
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def graph_file(tmp_path):
    path = tmp_path / "g.json"
    chain([1.0] * 12, act=10_000_000, param=2_000_000).save(path)
    return str(path)


def test_json_output_has_the_documented_keys(capsys, graph_file):
    code, out, _ = _run(capsys, graph_file, "--stages", "3", "--json")
    assert code == 0
    plan = json.loads(out)
    assert set(plan) == {"stages", "policies", "bottleneck_ms", "comm_bytes", "planner_s"}
    assert [len(s) for s in plan["stages"]] == [4, 4, 4]
    assert set(plan["policies"].values()) == {"D"} and len(plan["policies"]) == 12
    assert plan["bottleneck_ms"] == pytest.approx(4.0 + 2 * 500_000 / 10e9 * 1e3)
    assert plan["comm_bytes"] == 1_000_000 and plan["planner_s"] >= 0


def test_budget_schedule_method_and_bandwidth_options_reach_the_planner(capsys, graph_file):
    code, out, _ = _run(capsys, graph_file, "--stages", "2", "--memory-budget", "150MB", "--schedule",
                        "gpipe",
                        "--micro-batches", "4", "--method", "exact", "--copy-bandwidth", "1e9", "--json")
    assert code == 0
    plan = json.loads(out)
    assert any(p != "D" for p in plan["policies"].values())  # 6 layers x 4 x 10 MB would not fit


def test_table_output_names_every_stage(capsys, graph_file):
    code, out, _ = _run(capsys, graph_file, "--stages", "3")
    assert code == 0
    assert "slowest stage 4.100 ms" in out  # 4 ms of layers + two 500 kB boundaries at 10 GB/s
    for stage, first in ((0, 1000), (1, 1028), (2, 1056)):
        assert re.search(rf"^\s*{stage} \|\s+4 \| {first}\.\.", out, re.M), out


@pytest.mark.parametrize(("args", "message"), [
    (["--stages", "0"], "--stages must be at least 1, got 0"),
    (["--stages", "two"], "--stages must be an integer, got 'two'"),
    (["--stages", "13"], "--stages 13 is more than the graph's 12 layers"),
    (["--stages", "2", "--memory-budget=-5GB"], "must not be negative"),
    (["--stages", "2", "--memory-budget", "-5"], "must not be negative"),
    (["--stages", "2", "--memory-budget", "lots"], "memory budget 'lots' is not a byte size"),
    (["--stages", "2", "--memory-budget", "1MB"],
     "infeasible: layer 1000 (l0) needs 6000000 bytes > budget 1000000"),
    (["--stages", "2", "--schedule", "zb"], "--schedule must be one of gpipe, 1f1b, pipedream, pipedream2bw, "
                                             "interleaved1f1b, loopedbfs, interleavedzb, "
                                             "zbv, dualpipev, wpipe, got 'zb'"),
    (["--stages", "2", "--method", "metis"], "--method must be one of kl, exact, got 'metis'"),
    (["--stages", "2", "--micro-batches", "0"], "--micro-batches must be at least 1"),
    (["--stages", "2", "--network-bandwidth", "-1"], "--network-bandwidth must be a positive finite number"),
    ([], "the following arguments are required: --stages"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, graph_file, args, message):
    code, out, err = _run(capsys, graph_file, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("vpipe: error: ")
    assert message in err


def test_unreadable_and_invalid_graphs(capsys, tmp_path):
    code, _, err = _run(capsys, str(tmp_path / "missing.json"), "--stages", "2")
    assert code == 2 and err.startswith("vpipe: error: graph file ") and err.count("\n") == 1
    assert "missing.json does not exist" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": [{"id": 0}], "edges": []}')
    code, _, err = _run(capsys, str(bad), "--stages", "1")
    assert code == 2 and "node #0 is missing the key 'fwd_ms'" in err


def test_the_installed_command_prints_no_traceback(tmp_path):
    bad = tmp_path / "cyclic.json"
    bad.write_text(json.dumps({"nodes": [{"id": i, "fwd_ms": 1, "bwd_ms": 1, "act_bytes": 0, "param_bytes": 0,
                                          "order": i} for i in range(2)], "edges": [[1, 0, 4]]}))
    proc = run_vpipe("plan", str(bad), "--stages", "1", timeout=60, env=child_env())
    assert proc.returncode == 2
    assert proc.stderr.startswith("vpipe: error: ") and "Traceback" not in proc.stderr


def test_byte_sizes():
    assert parse_bytes("4096") == 4096
    assert parse_bytes("16e9") == 16_000_000_000
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("2GiB") == 2 * 2**30
    with pytest.raises(ValueError, match="must not be negative"):
        parse_bytes("-1")
