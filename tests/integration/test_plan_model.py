"""``vpipe plan --model``: a real model measured, planned, and printed in its own terms.

The plans must be valid contiguous splits of the modules the forward runs, in execution
order, named as the model names them; the ``split_spec`` printed must build a working
``torch.distributed.pipelining.pipeline`` whose output is the unsplit model's; every bad
factory, shape or budget must end in one ``vpipe: error:`` line and exit status 2.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from support.plan_cli import MODELS, json_plan, plan_command
from support.plan_models import EncoderDecoder, encoder_decoder
from support.processes import run_vpipe
from vpipe.graph import LayerGraph
from vpipe.profiling import find_units, profile_model
from vpipe_lab.runtime.models import reference_transformer

torch.set_num_threads(1)

REFERENCE = ["--model", "vpipe_lab.runtime.models:reference_transformer", "--input-shape", "4,64",
             "--input-dtype", "int64", "--repeats", "1"]
TWO_ARGUMENTS = ["--model", f"{MODELS}:encoder_decoder", "--repeats", "1"]
ENCODER_DECODER_ORDER = ["embed", "encoder.0", "encoder.1", "decoder.0", "decoder.1", "decoder.2",
                         "decoder.3",
                         "norm", "head"]






def _assert_valid(plan: dict, model: nn.Module, order: list[str], stages: int) -> None:
    """Contiguous, non-empty, every module once in execution order, names that exist, one policy each."""
    assert len(plan["stages"]) == stages and all(plan["stages"])
    assert [name for stage in plan["stages"] for name in stage] == order
    for name in order:
        model.get_submodule(name)  # raises if the model has no such module
    assert list(plan["policies"]) == order and set(plan["policies"].values()) <= {"D", "S", "R"}
    assert plan["split_spec"] == {stage[0]: "BEGINNING" for stage in plan["stages"][1:]}
    assert len(plan["stage_ms"]) == len(plan["stage_memory_bytes"]) == stages
    assert plan["bottleneck_ms"] == pytest.approx(max(plan["stage_ms"]))


def _pipeline_matches_the_model(model: nn.Module, x: torch.Tensor, split_spec: dict[str, str]) -> None:
    model.eval()
    pipe = pipeline(model, mb_args=(x,), split_spec={name: SplitPoint.BEGINNING for name in split_spec})
    assert pipe.num_stages == len(split_spec) + 1
    out = pipe(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple | list) else out, model(x))


# --------------------------------------------------------------------- valid plans in model terms
def test_the_reference_transformer_gets_a_contiguous_plan_in_its_module_names(capsys):
    plan = json_plan(capsys, *REFERENCE, "--stages", "3")
    model = reference_transformer()
    _assert_valid(plan, model, [str(i) for i in range(10)], 3)  # embedding, 8 blocks, head
    assert plan["layer_counts"] == {"": [len(s) for s in plan["stages"]]}  # the model is its own container
    assert plan["device"] == "cpu" and plan["step_ms"] > plan["bottleneck_ms"]


def test_the_reference_transformers_split_spec_builds_a_working_two_stage_pipeline(capsys):
    plan = json_plan(capsys, *REFERENCE, "--stages", "2")
    torch.manual_seed(0)
    _pipeline_matches_the_model(reference_transformer(dropout=0.0), torch.randint(0, 256, (4, 64)),
                                plan["split_spec"])


def test_blocks_with_two_arguments_and_a_keyword_get_a_plan_and_a_working_pipeline(capsys):
    plan = json_plan(capsys, *TWO_ARGUMENTS, "--stages", "2")
    model, x = encoder_decoder()
    _assert_valid(plan, model, ENCODER_DECODER_ORDER, 2)
    assert list(plan["layer_counts"]) == ["encoder", "decoder"]
    assert [sum(c) for c in plan["layer_counts"].values()] == [2, 4]
    _pipeline_matches_the_model(model, x, plan["split_spec"])


def test_the_table_names_modules_and_prints_what_a_trainer_needs(capsys):
    code, out, err = plan_command(capsys, *TWO_ARGUMENTS, "--stages", "2")
    assert code == 0 and err == ""
    assert (
        "split_spec for torch.distributed.pipelining.pipeline: {'" in out and "SplitPoint.BEGINNING}" in out
    )
    assert "blocks per stage for a manual split of decoder: " in out and "predicted step " in out
    assert "slowest stage " in out and " = compute " in out and "embed" in out and "head" in out


def test_a_memory_budget_gives_swap_or_recompute_policies_within_it(capsys):
    free = json_plan(capsys, *REFERENCE, "--stages", "2", "--schedule", "gpipe")
    budget = int(0.7 * max(free["stage_memory_bytes"]))
    tight = json_plan(capsys, *REFERENCE, "--stages", "2", "--schedule", "gpipe", "--memory-budget",
                      str(budget))
    assert set(tight["policies"].values()) & {"S", "R"}
    assert max(tight["stage_memory_bytes"]) <= budget


def test_the_measured_graph_is_saved_and_planned_again_in_module_names(capsys, tmp_path):
    path = tmp_path / "model.json"
    json_plan(capsys, *TWO_ARGUMENTS, "--stages", "2", "--save-graph", str(path))
    graph = LayerGraph.load(path)
    assert [n.name for n in graph.nodes] == ENCODER_DECODER_ORDER
    assert json.loads(path.read_text())["model"]["containers"] == ["encoder", "decoder"]
    again = json_plan(capsys, str(path), "--stages", "3")  # no measuring again, still in module names
    assert [name for stage in again["stages"] for name in stage] == ENCODER_DECODER_ORDER
    assert list(again["layer_counts"]) == ["encoder", "decoder"] and len(again["split_spec"]) == 2
    data = json.loads(path.read_text())
    data["model"]["blocks"] = {"decoder.0": "nowhere"}
    path.write_text(json.dumps(data))
    code, _, err = plan_command(capsys, str(path), "--stages", "2")
    assert code == 2 and err == ("vpipe: error: graph 'model' annotation: 'blocks' must map "
                                 "module names to one of 'containers'\n")


def test_a_hugging_face_gpt2_is_planned_in_its_module_names(capsys):
    pytest.importorskip("transformers")
    from support.plan_models import hf_gpt2

    plan = json_plan(capsys, "--model", f"{MODELS}:hf_gpt2", "--repeats", "1", "--stages", "3")
    model, _ = hf_gpt2()
    order = (["transformer.wte", "transformer.wpe", "transformer.drop"] + [f"transformer.h.{i}"
                                                                           for i in range(4)]
             + ["transformer.ln_f", "lm_head"])
    _assert_valid(plan, model, order, 3)
    assert list(plan["layer_counts"]) == ["transformer.h"] and sum(plan["layer_counts"]["transformer.h"]) == 4


# --------------------------------------------------------------------- units and the graph
def test_units_are_the_blocks_of_every_large_container_and_the_modules_beside_them():
    units, containers = find_units(EncoderDecoder())
    assert containers == ["decoder", "encoder"]  # by size; the graph puts them in execution order
    assert sorted(u.name for u in units) == sorted(ENCODER_DECODER_ORDER)
    assert {u.name: u.container for u in units}["decoder.2"] == "decoder"
    assert {u.name: u.container for u in units}["norm"] is None
    units, containers = find_units(EncoderDecoder(), ["encoder"])  # named: the decoder stays whole
    assert containers == ["encoder"] and "decoder" in [u.name for u in units]
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # nothing repeats: its children
    assert [u.name for u in find_units(plain)[0]] == ["0", "1", "2"]
    with pytest.raises(ValueError, match="has no submodule 'nope'"):
        find_units(plain, ["nope"])


def test_the_encoders_output_is_a_skip_edge_to_every_decoder_block():
    model, x = encoder_decoder()
    mg = profile_model(model, (x,), repeats=1)
    names = [n.name for n in mg.graph.nodes]
    assert names == ENCODER_DECODER_ORDER
    memory = names.index("encoder.1")
    skips = {names[d] for s, d, _ in mg.graph.edges if s == memory and d > memory + 1}
    assert skips == {"decoder.1", "decoder.2", "decoder.3"}
    hidden = x.numel() * 32 * 4
    assert all(b >= hidden for _, _, b in mg.graph.edges[1:])
    node = mg.graph.nodes[names.index("decoder.0")]
    assert node.fwd_s > 0 and node.bwd_s > 0 and node.act_bytes > hidden and node.param_bytes > 0


# --------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no_colon_here"], "--model must be MODULE:FACTORY"),
        (["--model", "no_such_module_xyz:build"], "--model: cannot import module 'no_such_module_xyz'"),
        (["--model", f"{MODELS}:missing"], f"--model: {MODELS!r} has no 'missing'"),
        (["--model", "tests/nowhere.py:build"], "--model: no file 'tests/nowhere.py'"),
        (["--model", "tests/workers/:build"], "--model: 'tests/workers/' is a directory, not a Python file"),
        (["--model", "/dev/null:build"], "--model: '/dev/null' is a device, not a Python file"),
        (
            ["--model", f"{MODELS}:raises"],
            f"--model: {MODELS}:raises() raised RuntimeError: the factory failed",
        ),
        (
            ["--model", f"{MODELS}:not_a_module"],
            f"--model: {MODELS}:not_a_module() returned int; it must return an nn.Module",
        ),
        (["--model", "vpipe_lab.runtime.models:reference_transformer"], "--input-shape is needed"),
        (
            ["--model", "vpipe_lab.runtime.models:reference_transformer", "--input-shape", "4,x"],
            "--input-shape must be positive integers separated by commas, like 8,128; got '4,x'",
        ),
        (["--model", "vpipe_lab.runtime.models:reference_transformer", "--input-shape", "4,0"], "got '4,0'"),
        (
            [
                "--model",
                "vpipe_lab.runtime.models:reference_transformer",
                "--input-shape",
                "4,64",
                "--input-dtype",
                "int99",
            ],
            "--input-dtype must be one of float32",
        ),
        (
            ["--model", "vpipe_lab.runtime.models:reference_transformer", "--input-shape", "4,64"],
            "running the model on the example input failed: RuntimeError: "
            "Expected tensor for argument #1 'indices'",
        ),
        (
            [*TWO_ARGUMENTS, "--input-shape", "4,64"],
            "--input-shape and --input-dtype are for factories that return only a model",
        ),
        ([*REFERENCE, "--memory-budget", "1kB"], "infeasible: layer "),
        ([*REFERENCE, "--stages", "11"], "--stages 11 is more than the model's 10 placement units"),
        ([*REFERENCE, "--layers", "nope"], "--layers: the model (Sequential) has no submodule 'nope'"),
        ([*REFERENCE, "--device", "tpu"], "--device must be cpu, cuda, cuda:N or auto; got 'tpu'"),
        ([*REFERENCE, "--repeats", "0"], "--repeats must be at least 1"),
        ([*REFERENCE, "graph.json"], "give GRAPH.json or --model MODULE:FACTORY, not both"),
        ([], "give either GRAPH.json or --model MODULE:FACTORY"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    if "--stages" not in args:
        args = [*args, "--stages", "2"]
    code, out, err = plan_command(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("vpipe: error: "), err
    assert message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line(capsys):
    code, _, err = plan_command(capsys, *REFERENCE, "--stages", "2", "--device", "cuda")
    assert code == 2 and err.startswith("vpipe: error: --device cuda: this machine has no CUDA device")


@pytest.mark.cuda
def test_a_model_is_measured_on_the_gpu(capsys):
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    plan = json_plan(capsys, *TWO_ARGUMENTS, "--stages", "2", "--device", "cuda")
    assert plan["device"] == "cuda"
    _assert_valid(plan, encoder_decoder()[0], ENCODER_DECODER_ORDER, 2)


def test_the_installed_command_prints_one_line_not_a_traceback():
    proc = run_vpipe("plan", "--model", f"{MODELS}:raises", "--stages", "2", timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr == f"vpipe: error: --model: {MODELS}:raises() raised RuntimeError: the factory failed\n"
    )
