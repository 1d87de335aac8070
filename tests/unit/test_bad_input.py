"""Bad input of every kind is rejected with a message that names the fault, never a crash.

Covered elsewhere (not repeated): graph JSON with cycles, self-loops, negative costs and
unknown node ids (``test_graph.py``); the control-message envelope, size caps and raw-byte
fuzzing (``test_control_messages.py``); stale plans at a stage agent
(``test_control_agent.py::test_stale_and_misshapen_plans_are_dropped_with_a_log_line``);
migration manifests with bad shapes/dtypes/sizes (``test_migration_state.py``); the planner
CLI's negative budgets (``test_planner_cli.py``); a damaged checkpoint (``test_checkpoint.py``).
"""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vpipe.migration.messages  # noqa: F401 - registers the migration message types with the decoder
from support.control import VALID, assert_dropped_cleanly, packed, plain, wire_of
from support.monitors import stage_record
from vpipe import VpipeConfig
from vpipe.checkpoint import CheckpointError, check_vpipe_state
from vpipe.control.messages import DecodeError, decode, encode, make, registered_types
from vpipe.migration.state import validate_manifest
from vpipe.plan import Plan, PlanError, Policy
from vpipe.rank.plan_in_force import PlanInForce
from vpipe_lab.runtime.config import RunConfig

# ---------------------------------------------------------------------- plans
PLAN = {"epoch": 3, "stages": [[0, 1], [2, 3]], "policies": {"1": "S"}, "predicted_step_s": 0.5,
        "reason": "r"}


@pytest.mark.parametrize("change, message", [
    ({"epoch": -1}, "plan epoch must be a non-negative integer, got -1"),
    ({"epoch": True}, "plan epoch must be a non-negative integer, got True"),
    ({"epoch": 2.0}, "plan epoch must be a non-negative integer, got 2.0"),
    ({"stages": []}, "a plan needs at least one stage"),
    ({"stages": [[0, 1], []]}, "stage 1 of the plan has no layers"),
    ({"stages": [[0, -4], [2, 3]]}, "stage 0: layer id -4 is not a non-negative integer"),
    ({"stages": [[0, "1"], [2, 3]]}, "stage 0: layer id '1' is not a non-negative integer"),
    ({"stages": [[0, 1], [1, 3]]}, "layer 1 is placed twice"),
    ({"stages": [0, 1]}, "plan 'stages' must be a list of lists of layer ids"),
    ({"policies": {"7": "S"}}, "policies name layers the plan does not place: [7]"),
    ({"policies": {"1": "X"}}, "unknown policy 'X'; expected one of D, S, R"),
    ({"policies": {"one": "S"}}, "policy key 'one' is not a layer id"),
    ({"policies": [1]}, "plan 'policies' must be a map from layer id to D/S/R"),
    ({"predicted_step_s": -1.0}, "predicted step time must be finite and >= 0, got -1.0"),
    ({"predicted_step_s": math.inf}, "predicted step time must be finite and >= 0, got inf"),
    ({"predicted_step_s": 10 ** 400}, "plan 'predicted_step_s' is out of range"),
    ({"predicted_step_s": "fast"}, "plan 'predicted_step_s' must be a number"),
    ({"reason": 5}, "plan 'reason' must be a string"),
])
def test_malformed_plans_are_rejected_with_the_fault_named(change, message):
    assert Plan.from_wire(dict(PLAN)).to_wire() == PLAN
    with pytest.raises(PlanError) as err:
        Plan.from_wire({**PLAN, **change})
    assert str(err.value).startswith(message), str(err.value)


def test_a_plan_without_epoch_or_stages_is_rejected():
    for key in ("epoch", "stages"):
        with pytest.raises(PlanError, match=f"plan is missing '{key}'"):
            Plan.from_wire({k: v for k, v in PLAN.items() if k != key})
    with pytest.raises(PlanError, match="a plan must be a map, got list"):
        Plan.from_wire([1, 2])


@pytest.fixture
def owner() -> PlanInForce:
    return PlanInForce(Plan(epoch=5, stages=((0, 1), (2, 3))), [])


@pytest.mark.parametrize("stages, message", [
    ([[0, 1], [2, 3, 9]], "plan names unknown layers [9]"),
    ([[0, 1], [2]], "plan leaves layers [3] unplaced"),
    ([[0, 2], [1, 3]], "plan reorders layers: every stage must hold a contiguous run"),
    ([[0], [1], [2, 3]], "plan has 3 stages, the pipeline has 2"),
])
def test_plans_that_do_not_fit_the_pipeline_are_refused_before_they_take_effect(owner, stages, message):
    plan = Plan(epoch=6, stages=tuple(tuple(s) for s in stages))
    with pytest.raises(PlanError) as err:
        owner.check(plan, [0, 1, 2, 3], 2)
    assert str(err.value).startswith(message)
    assert owner.plan == Plan(epoch=5, stages=((0, 1), (2, 3)))  # untouched


@pytest.mark.parametrize("epoch, stale", [(5, True), (2, True), (6, False)])
def test_plans_not_newer_than_the_plan_in_force_are_stale(owner, epoch, stale):
    assert owner.stale(Plan(epoch=epoch, stages=((0,), (1, 2, 3)))) is stale


# ---------------------------------------------------------------------- messages
def test_a_stats_record_with_negative_sizes_is_dropped_naming_the_field():
    wire = wire_of(VALID[0])
    wire["body"]["records"][0]["layers"][0]["activation_bytes"] = -5
    with pytest.raises(DecodeError) as err:
        decode(packed(wire))
    assert err.value.reason == "bad_body" and "activation_bytes" in str(err.value)


@pytest.mark.parametrize("change, message", [
    ({"stage": -2}, "stage must be an integer in [-1, 65536], got -2"),
    ({"stage": 70000}, "stage must be an integer in [-1, 65536], got 70000"),
    ({"epoch": -3}, "epoch must be an integer in [0, 9223372036854775807], got -3"),
])
def test_out_of_range_stages_and_epochs_in_messages_are_named(change, message):
    wire = wire_of(VALID[1])
    wire.update(change)
    with pytest.raises(DecodeError) as err:
        decode(packed(wire))
    assert err.value.reason == "bad_field" and message in str(err.value)


# ---------------------------------------------------------------------- configurations
@pytest.mark.parametrize("kwargs, message", [
    ({"stages": 20}, "20 stages but the model has only 10 layers"),
    ({"stages": 0}, "stages must be a positive integer, got 0"),
    ({"steps": -1}, "steps must be >= 0, got -1"),
    ({"dropout": 1.0}, "dropout must be in [0, 1), got 1.0"),
    ({"lr": 0.0}, "lr must be a positive finite number, got 0.0"),
    ({"d_model": 30, "n_heads": 4}, "d_model (30) must be divisible by n_heads (4)"),
    ({"d_model": 1_000_000},
     "the model's weights, gradients and optimizer state would take about 1,430,511 GiB"),
    ({"micro_batch_size": 10**9}, "one micro-batch's activations would take about 2,441,406 GiB"),
    ({"schedule": "1f1b", "stages": 4, "micro_batches": 2}, "1f1b needs micro_batches >= stages (2 < 4)"),
    ({"schedule": "zero-bubble"},
     "schedule must be one of gpipe, 1f1b, pipedream, pipedream2bw, interleaved1f1b, "
                                    "loopedbfs, interleavedzb, zbv, dualpipev, wpipe, got 'zero-bubble'"),
    ({"memory_budget": 0}, "memory_budget must be a positive number of bytes, got 0"),
    ({"memory_budget": -1}, "memory_budget must be a positive number of bytes, got -1"),
    ({"policy": "X"}, "policy must be D, S or R, got 'X'"),
    ({"partition": [5, 0, 5]}, "partition has 3 entries for 2 stages"),
    ({"partition": [10, 0]}, "every stage needs at least one layer, got partition [10, 0]"),
    ({"partition": [4, 4]}, "partition [4, 4] covers 8 layers, the model has 10"),
    ({"moves": [{"step": 3, "partition": [5, 5]}]}, "forced moves need vpipe"),
    ({"vpipe": True, "moves": [{"step": 0, "partition": [5, 5]}]},
     "moves[0]: steps must be increasing integers >= 1"),
    ({"vpipe": True, "moves": [{"step": 2, "partition": [9, 2]}]},
     "moves[0]: partition [9, 2] must give each"),
    ({"vpipe": True, "nas": [{"step": 1, "remove": [0]}]},
     "nas[0]: cannot remove [0]: not a block of the model"),
    ({"vpipe": True, "nas": [{"step": 1, "add": {"position": 0, "types": ["attn"]}}]},
     "nas[0]: position must be between 1 and 9"),
    ({"monitor_every": -1}, "monitor_every must be an integer >= 0, got -1"),
])
def test_impossible_run_configs_are_rejected(kwargs, message):
    with pytest.raises(ValueError) as err:
        RunConfig(**kwargs)
    assert message in str(err.value), str(err.value)


def test_unknown_run_config_keys_are_named():
    with pytest.raises(ValueError, match="unknown run config keys: stagez"):
        RunConfig.from_dict({"stagez": 2})


@pytest.mark.parametrize("kwargs, message", [
    ({"memory_budget": 0}, "memory_budget must be a positive number of bytes, 'auto' or None, got 0"),
    ({"sample_every": 0}, "sample_every must be an integer in [1, 1000000000], got 0"),
    ({"planner": "nocolon"}, "planner must be 'module:function', got 'nocolon'"),
    ({"migration_timeout_s": -1.0}, "migration_timeout_s must be positive, got -1.0"),
    ({"migration_timeout_s": math.nan}, "migration_timeout_s must be positive, got nan"),
    ({"apply_lag_steps": 0}, "apply_lag_steps must be an integer in [1, 10000], got 0"),
    ({"apply_lag_steps": 10**12}, "apply_lag_steps must be an integer in [1, 10000], got 1000000000000"),
    ({"apply_lag_steps": 2.0}, "apply_lag_steps must be an integer in [1, 10000], got 2.0"),
    ({"planning": "no"}, "planning must be True or False, got 'no'"),
    ({"tensor_manager": 0}, "tensor_manager must be True or False, got 0"),
    ({"sample_every": "10"}, "sample_every must be an integer in [1, 1000000000], got '10'"),
    ({"sample_every": True}, "sample_every must be an integer in [1, 1000000000], got True"),
    ({"agree_timeout_s": "60"}, "agree_timeout_s must be positive, got '60'"),
    ({"migration_timeout_s": 1e300}, "migration_timeout_s must be positive, got 1e+300"),
    ({"min_swap_bytes": "1k"}, "min_swap_bytes must be >= 0"),
    ({"host_pool_bytes": 1.5}, "host_pool_bytes must be positive"),
    ({"policies": ["R"]}, "policies must map layer ids (integers >= 0) to 'D', 'S' or 'R', got ['R']"),
    ({"policies": {"0": "R"}},
     "policies must map layer ids (integers >= 0) to 'D', 'S' or 'R', got {'0': 'R'}"),
    ({"specs": [1]}, "specs must be a mapping, got [1]"),
    ({"planner_options": None}, "planner_options must be a dict of plain JSON values, got None"),
    ({"planner_options": {"min_gain": float("nan")}},
     "planner_options must be a dict of plain JSON values, got {'min_gain': nan}"),
    ({"planner_options": {"in_flight": (2, 1)}},
     "planner_options must be a dict of plain JSON values, got {'in_flight': (2, 1)}"),
    ({"log_file": 3}, "log_file must be a path or None, got 3"),
    ({"min_swap_bytes": -1}, "min_swap_bytes must be >= 0"),
    ({"host_pool_bytes": 0}, "host_pool_bytes must be positive"),
    ({"layer_factory": 3}, "layer_factory must be callable"),
    ({"memory_budget": "16 apples"},
     "memory_budget '16 apples' is not a byte size (examples: 16000000000, 16e9, 16GB, 15GiB, 512M)"),
    ({"memory_budget": "1e400G"},
     "memory_budget '1e400G' is larger than any machine (4611686018427387904 bytes at most)"),
    ({"micro_batches": 0}, "micro_batches must be a positive integer or None, got 0"),
])
def test_impossible_vpipe_configs_are_rejected(kwargs, message):
    with pytest.raises(ValueError) as err:
        VpipeConfig(**kwargs)
    assert str(err.value) == f"vpipe config: {message}"
    with pytest.raises(PlanError, match="unknown policy 'Q'"):
        VpipeConfig(policies={0: "Q"})


# ---------------------------------------------------------------------- property tests over the decoders
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
layer_ids = st.one_of(st.integers(-3, 12), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3),
                      st.none())
garbage_plan = st.fixed_dictionaries(
    {"epoch": st.one_of(st.integers(-(1 << 70), 1 << 70), plain),
     "stages": st.one_of(st.lists(st.lists(layer_ids, max_size=4), max_size=4), plain)},
    optional={"policies": st.one_of(st.dictionaries(st.one_of(st.text(max_size=4), st.integers(),
                                                              st.floats()),
                                                    st.one_of(st.sampled_from("DSRX"), plain), max_size=4),
                                    plain),
              "predicted_step_s": st.one_of(st.floats(), st.integers(-(1 << 70), 1 << 1100), plain),
              "reason": plain, "extra": plain},
)


def assert_only_rejects(check, data, error: type[Exception]) -> None:
    """``check(data)`` accepts, or raises ``error`` with a message; any other exception fails the test."""
    try:
        check(data)
    except error as e:
        assert str(e), "a rejection must say why"
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__name__} escaped {check.__name__} for {data!r:.200}: {e}")


def assert_plan_or_plan_error(data) -> None:
    try:
        plan = Plan.from_wire(data)
    except PlanError as e:
        assert str(e), "a rejection must say why"
        return
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__name__} escaped Plan.from_wire for {data!r:.200}: {e}")
    # whatever is accepted is a coherent plan that survives its own wire format
    assert Plan.from_wire(plan.to_wire()) == plan
    assert all(isinstance(p, Policy) for p in plan.policies.values())


@FUZZ
@given(data=st.one_of(garbage_plan, plain))
def test_fuzz_plan_decoder_with_structured_garbage(data):
    assert_plan_or_plan_error(data)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_fuzz_plan_decoder_with_raw_msgpack_bytes(raw):
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - not msgpack at all: the message decoder's business (fuzzed there)
        return
    assert_plan_or_plan_error(data)


@FUZZ
@given(plan=garbage_plan)
def test_fuzz_plan_messages_through_the_control_decoder(plan):
    wire = wire_of(VALID[1])
    wire["body"]["plan"] = plan
    try:
        data = packed(wire)
    except (OverflowError, TypeError, ValueError):  # not representable in msgpack: cannot arrive
        return
    assert_dropped_cleanly(data)


@FUZZ
@given(kind=st.sampled_from(sorted(registered_types())), body=plain, epoch=st.integers(-2, 5))
def test_fuzz_every_registered_type_with_garbage_bodies(kind, body, epoch):
    wire = {"v": 1, "type": kind, "epoch": epoch, "iter": 0, "stage": 0, "src": 0, "body": body}
    assert_dropped_cleanly(packed(wire))


@FUZZ
@given(manifest=st.one_of(plain, st.fixed_dictionaries(
    {"layer": st.one_of(st.integers(-2, 5), plain),
     "entries": st.lists(st.one_of(plain, st.fixed_dictionaries(
         {"kind": st.sampled_from(["param", "optim", "buffer", "optim_value", "x"]), "name": plain,
          "shape": st.one_of(st.lists(st.integers(-2, 4), max_size=3), plain), "dtype": st.one_of(
              st.sampled_from(["float32", "int64", "complex64"]), plain),
          "nbytes": st.one_of(st.integers(-8, 64),
                                                                                                plain)})),
         max_size=3)})))
def test_fuzz_migration_manifests(manifest):
    assert_only_rejects(validate_manifest, manifest, ValueError)


@FUZZ
@given(state=st.one_of(plain, st.fixed_dictionaries(
    {"version": st.one_of(st.just(1), plain), "epoch": st.one_of(st.integers(-1, 3), plain),
     "iteration": st.one_of(st.integers(-1, 3), plain),
     "stages": st.one_of(st.lists(st.lists(layer_ids, max_size=3),
                                                                                      max_size=3), plain),
     "policies": st.one_of(st.dictionaries(st.text(max_size=3), st.sampled_from("DSRQ"), max_size=3), plain),
     "next_layer_id": st.one_of(st.integers(-1, 20), plain)})))
def test_fuzz_checkpoint_vpipe_state(state):
    assert_only_rejects(check_vpipe_state, state, CheckpointError)


def test_the_fuzzed_decoders_accept_what_vpipe_itself_sends():
    plan = Plan(epoch=4, stages=((0, 1), (2,)), policies={2: Policy.RECOMPUTE}, predicted_step_s=0.1)
    assert decode(encode(make("plan", plan, epoch=4))).body == plan
    record = stage_record(0, 3, (0, 1))
    assert decode(encode(make("stats", (record,), iteration=3, stage=0))).body == (record,)


# ---------------------------------------------------------------------- files and disks
def test_a_failing_run_log_write_is_reported_once_and_dropped(capfd):
    import logging

    from vpipe import log as run_log

    run_log.configure("/dev/full", rank=3)
    try:
        for step in range(100):  # steps are written 16 at a time; decisions one by one
            run_log.step_record(step, 0.01, stage=1)
            run_log.decision("plan_received", "a plan", epoch=step)
        logging.getLogger("vpipe.control").warning("a warning too")
    finally:
        run_log.configure(None)
    err = capfd.readouterr().err
    assert err.splitlines() == ["vpipe [rank 3]: cannot write the run log /dev/full (No space left on "
                                "device); training goes on, and its further log records are dropped"]


def test_a_planner_returning_a_huge_epoch_cannot_lock_out_its_own_daemon():
    from vpipe.control.planner_function import plan_problem

    layers = [0, 1, 2, 3]
    current = Plan(epoch=3, stages=((0, 1), (2, 3)))
    huge = Plan(epoch=2**63 - 1, stages=((0, 1, 2), (3,)))
    assert plan_problem(huge, current, None,
                        layers) == "epoch 9223372036854775807 jumps more than 1000 past the current epoch 3"
    next_plan = Plan(epoch=4, stages=((0, 1, 2), (3,)))  # the next real plan
    assert plan_problem(next_plan, current, None, layers) is None
    assert plan_problem(Plan(epoch=1001, stages=((0,), (1, 2, 3))), None, None, layers) is not None


def test_vpipe_logs_shows_escape_sequences_and_markup_from_a_log_as_text(tmp_path, capsys):
    import json as json_

    from vpipe_lab.logview import render

    log = tmp_path / "run.log"
    hostile = "plan \x1b[2J\x1b]0;pwned\x07 [bold red]x[/] \u202eevil\x9b"
    log.write_text(json_.dumps({"t": 1.0, "rank": 1, "logger": "vpipe.decisions", "level": "INFO",
                                "event": "plan_received", "reason": hostile, "msg": hostile}) + "\n")
    assert render(str(log)) == 0
    out = capsys.readouterr().out
    assert not any(ord(ch) < 32 and ch != "\n" or 0x7f <= ord(ch) < 0xa0 or ch == "\u202e" for ch in out), out
    assert "\\x1b[2J" in out and "\\x07" in out and "\\u202e" in out and "[bold red]x[/]" in out


def test_vpipe_logs_cuts_a_huge_line_saying_how_much_instead_of_folding_it_whole(tmp_path, capsys):
    """A 16 MB log line used to take 44 s to show: the table's folding is quadratic in a cell's length."""
    import json as json_

    from vpipe_lab.logview import MAX_CELL, render

    log = tmp_path / "run.log"
    huge = "x" * 2_000_000
    log.write_text(json_.dumps({"t": 1.0, "rank": 0, "logger": "vpipe.decisions", "level": "INFO",
                                "event": "plan_received", "msg": huge}) + "\n")
    assert render(str(log)) == 0
    out = capsys.readouterr().out
    assert f"({2_000_000 - MAX_CELL} more characters)" in out
    assert out.count("x") < 2 * MAX_CELL


def test_a_checkpoint_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    import resource
    import signal

    from vpipe.checkpoint.files import atomic_write

    target = tmp_path / "manifest.json"
    atomic_write(target, b"the previous checkpoint")
    # the write fails with EFBIG, as on a full disk
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))
    try:
        with pytest.raises(OSError):
            atomic_write(target, b"x" * 100_000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert target.read_bytes() == b"the previous checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # no .manifest.json.tmp-PID left
