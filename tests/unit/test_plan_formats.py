"""``vpipe plan`` in torchtitan's and Megatron-LM's terms, and for the multi-stage schedules.

The torchtitan fields and the Megatron layout string it prints are read back with readers
written from those frameworks' documented rules (``tests/support/plan_formats.py``) and must give
vpipe's own split: the same modules per stage, the same ranks. A form a framework cannot
express is left out with the reason, and the readers confirm it could not. Multi-stage plans
are made with the numbers the live planner uses (stage ranks and in-flight counts read off
torch's action lists) and equal the live planner's own search on the same graph.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining.schedules import get_schedule_class

from support.graphs import chain
from support.plan_cli import MODELS, json_plan, plan_command
from support.plan_formats import (
    megatron_layout,
    torchtitan_layers_per_stage,
    torchtitan_split,
    torchtitan_stage_ranks,
)
from support.plan_models import encoder_decoder, tutorial_transformer
from vpipe.plan import Plan, Policy
from vpipe.planner.cost_model import GraphProfile
from vpipe.planner.online import OnlineConfig, OnlinePlanner
from vpipe.planner.srp import srp_loop
from vpipe.schedules.wpipe_order import steady_order
from vpipe.stage.pipeline import in_flight_per_stage, in_flight_together
from vpipe_lab.runtime.models import reference_transformer

torch.set_num_threads(1)

TUTORIAL = ["--model", f"{MODELS}:tutorial_transformer", "--repeats", "1", "--micro-batches", "4"]


def _blocks(plan: dict) -> list[int]:
    container = next(iter(plan["layer_counts"]))
    return plan["layer_counts"][container]


def _assert_torchtitan_reads_the_plan(plan: dict, model: torch.nn.Module, ranks: int) -> None:
    titan = plan["torchtitan"]
    assert titan["pipeline_parallel_degree"] == ranks
    # what torchtitan does with the name: it must exist
    get_schedule_class(titan["pipeline_parallel_schedule"])
    assert torchtitan_split(model, titan["module_fqns_per_model_part"]) == plan["stages"]
    stage_ranks = plan.get("stage_ranks", list(range(len(plan["stages"]))))
    assert torchtitan_stage_ranks(titan["pipeline_parallel_schedule"], len(plan["stages"]),
                                  ranks) == stage_ranks


def _assert_megatron_reads_the_plan(plan: dict, ranks: int, embedding: set[str], loss: set[str]) -> None:
    mega = plan["megatron"]
    assert mega["pipeline_model_parallel_size"] == ranks and mega["notes"] == []
    stages = megatron_layout(mega["pipeline_model_parallel_layout"], ranks, sum(_blocks(plan)))
    assert [stage.count("t") for stage in stages] == _blocks(plan)
    assert [("E" in stage, "L" in stage) for stage in stages] == [
        (bool(embedding & set(names)), bool(loss & set(names))) for names in plan["stages"]]
    stage_ranks = plan.get("stage_ranks", list(range(len(plan["stages"]))))
    assert [i % ranks for i in range(len(stages))] == stage_ranks  # Megatron's placement is vpipe's


# --------------------------------------------------------------------- the tutorial / torchtitan model
@pytest.mark.parametrize("stages", ["2", "3"])
def test_the_tutorial_models_plan_reads_back_the_same_in_torchtitan_and_megatron(capsys, stages):
    plan = json_plan(capsys, *TUTORIAL, "--stages", stages)
    model, _ = tutorial_transformer()
    _assert_torchtitan_reads_the_plan(plan, model, int(stages))
    _assert_megatron_reads_the_plan(plan, int(stages), {"tok_embeddings"}, {"norm", "output"})
    titan = plan["torchtitan"]
    first, last = (titan["pipeline_parallel_first_stage_less_layers"],
                   titan["pipeline_parallel_last_stage_less_layers"])
    if first is not None:  # torchtitan's own split, from the two numbers, gives the same blocks per stage
        assert torchtitan_layers_per_stage(len(plan["stages"]), 6, first, last) == _blocks(plan)
    else:
        assert titan["notes"] == [f"first/last_stage_less_layers: no pair gives blocks per stage "
                                  f"{','.join(map(str, _blocks(plan)))} with 1 stage(s) per rank"]


def test_the_table_prints_the_torchtitan_fields_and_the_megatron_flags(capsys):
    code, out, err = plan_command(capsys, *TUTORIAL, "--stages", "2")
    assert code == 0 and err == ""
    plan = json_plan(capsys, *TUTORIAL, "--stages", "2")  # measured again: compare the shape of the lines
    assert "torchtitan, [parallelism] of the job config:" in out
    assert '  pipeline_parallel_degree = 2\n  pipeline_parallel_schedule = "1F1B"\n' in out
    assert '  module_fqns_per_model_part = [["tok_embeddings", "layers.0"' in out
    line = next(x for x in out.splitlines() if x.startswith("Megatron-LM: "))
    assert line.startswith(
        'Megatron-LM: --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "E'
    )
    assert line.endswith(',L"') and plan["megatron"]["pipeline_model_parallel_layout"].count("|") == 1


# --------------------------------------------------------------------- the other example models
def test_a_hugging_face_gpt2_gets_a_megatron_layout_and_no_torchtitan_list_it_cannot_split(capsys, tmp_path):
    pytest.importorskip("transformers")
    from support.plan_models import hf_gpt2

    # the model measured, then planned from its graph with the times pinned: where the cuts fall must not
    # depend on this machine's load (on CI's, with another worker busy, a module before the blocks was once
    # timed as slow as a block, and the plan cut between them, which Megatron's layout then rightly notes)
    graph = tmp_path / "gpt2.json"
    json_plan(capsys, "--model", f"{MODELS}:hf_gpt2", "--repeats", "1", "--stages", "3", "--save-graph",
              str(graph))
    measured = json.loads(graph.read_text())
    for node in measured["nodes"]:
        block = node["name"].startswith("transformer.h.")
        node["fwd_ms"], node["bwd_ms"] = (2.0, 4.0) if block else (0.1, 0.2)
    graph.write_text(json.dumps(measured))
    plan = json_plan(capsys, str(graph), "--stages", "3")
    _assert_megatron_reads_the_plan(plan, 3, {"transformer.wte", "transformer.wpe", "transformer.drop"},
                                    {"transformer.ln_f", "lm_head"})
    titan = plan["torchtitan"]
    assert titan["module_fqns_per_model_part"] is None
    assert titan["notes"][0] == ("module_fqns_per_model_part: torchtitan splits only top-level children and "
                                 "the entries of top-level ModuleList/ModuleDict containers; transformer.wte "
                                 "is deeper")
    model, _ = hf_gpt2()
    assert torchtitan_split(model, plan["stages"]) != plan["stages"]  # torchtitan would not make this split


def test_a_sequential_model_gets_torchtitan_names_and_no_megatron_layout(capsys):
    plan = json_plan(capsys, "--model", "vpipe_lab.runtime.models:reference_transformer", "--input-shape",
                     "4,64",
                      "--input-dtype", "int64", "--repeats", "1", "--stages", "3")
    _assert_torchtitan_reads_the_plan(plan, reference_transformer(), 3)
    assert plan["megatron"] == {
        "pipeline_model_parallel_size": 3, "pipeline_model_parallel_layout": None,
        "notes": ["pipeline_model_parallel_layout: the model has no module before its blocks "
                  "to be the embedding and the head"]}


def test_two_block_stacks_get_no_megatron_layout(capsys):
    plan = json_plan(capsys, "--model", f"{MODELS}:encoder_decoder", "--repeats", "1", "--stages", "2")
    _assert_torchtitan_reads_the_plan(plan, encoder_decoder()[0], 2)
    assert plan["megatron"]["pipeline_model_parallel_layout"] is None
    assert plan["megatron"]["notes"] == ["pipeline_model_parallel_layout: the model has 2 "
                                         "block containers; these forms describe one stack of blocks"]


# --------------------------------------------------------------------- multi-stage schedules
@pytest.mark.parametrize(("schedule", "megatron"), [("interleaved1f1b", True), ("zbv", False)])
def test_a_multi_stage_plan_has_a_stage_per_rank_and_virtual_stage_and_reads_back(capsys, schedule, megatron):
    plan = json_plan(capsys, *TUTORIAL, "--stages", "2", "--schedule", schedule, "--stages-per-rank", "2")
    assert len(plan["stages"]) == 4
    assert plan["stage_ranks"] == ([0, 1, 0, 1] if schedule == "interleaved1f1b" else [0, 1, 1, 0])
    model, _ = tutorial_transformer()
    _assert_torchtitan_reads_the_plan(plan, model, 2)
    if megatron:
        _assert_megatron_reads_the_plan(plan, 2, {"tok_embeddings"}, {"norm", "output"})
    else:
        assert plan["megatron"]["notes"] == ["pipeline_model_parallel_layout: Megatron places "
                                             "stage i on rank i % 2; zbv places its stages in a V"]


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "zbv"])
def test_an_offline_multi_stage_plan_is_the_live_planners_plan_for_the_same_graph(capsys, tmp_path, schedule):
    """The live planner gets stage ranks and in-flight counts from the ranks (``Pipeline.in_flight``: torch's
    action lists); its SRP search on the same graph, budget and schedule must give the offline plan."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    graph = chain([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0], act=40_000_000, param=4_000_000)
    path = tmp_path / "graph.json"
    graph.save(path)
    budget = 700_000_000  # a rank's: two stages share it, some layers must swap or recompute
    offline = json_plan(capsys, str(path), "--stages", "2", "--schedule", schedule, "--micro-batches", "4",
                         "--memory-budget", str(budget))
    cls = ScheduleInterleaved1F1B if schedule == "interleaved1f1b" else ScheduleZBVZeroBubble
    order = dict(enumerate(get_schedule_ops(cls, 2, 4, 2)))
    style = "v" if schedule == "zbv" else "loop"
    ranks = [generate_stage_to_rank_mapping(2, 4, style=style)[v] for v in range(4)]
    config = OnlineConfig(schedule=schedule, micro_batches=4, memory_budget=budget,
                          in_flight=in_flight_per_stage(order, 4), stage_ranks=ranks,
                          in_flight_together=in_flight_together(order, 4))
    records = {node.id: SimpleNamespace(param_bytes=node.param_bytes, optimizer_bytes=node.param_bytes)
               # Adam-like state: the live planner's optimizer factor is then the default
               for node in graph.nodes}
    ids = [node.id for node in graph.nodes]
    current = Plan(0, tuple(tuple(ids[i:i + 3]) for i in (0, 3, 6)) + ((ids[9],),),
                   {lid: Policy.KEEP for lid in ids})
    live = OnlinePlanner(config)._planner(graph, records, current)
    best, _ = srp_loop(GraphProfile(graph), live.setup, live.budgets, live.method)
    assert offline["stage_ranks"] == ranks and offline["in_flight"] == list(config.in_flight)
    assert offline["stages"] == GraphProfile(graph).stages_of(best.cuts)
    policies = GraphProfile(graph).policies_from(best.codes)
    assert offline["policies"] == {str(lid): policy.value for lid, policy in policies.items()}
    assert set(offline["policies"].values()) & {"S", "R"}  # the budget binds: the shares matter
    assert offline["bottleneck_ms"] == pytest.approx(best.bottleneck_s * 1e3)


def test_a_wpipe_plan_is_made_with_the_lists_the_schedule_writes(capsys, tmp_path):
    """``vpipe plan --schedule wpipe``: G0's stages and G1's on ranks ``v mod W``, in flight as the ranks read
    off ``ScheduleWPipe.pipeline_order`` (G0's stage 0 holds the period before and this one's warm-up), two
    weight versions on G0's stages; the plan is the live planner's search with the same numbers."""
    graph = chain([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0], act=40_000_000, param=4_000_000)
    path = tmp_path / "graph.json"
    graph.save(path)
    offline = json_plan(capsys, str(path), "--stages", "2", "--schedule", "wpipe", "--micro-batches", "3",
                        "--memory-budget", "700000000")
    order = dict(steady_order(2, 3))
    assert offline["stage_ranks"] == [0, 1, 0, 1] and offline["in_flight"] == [5, 4, 2, 1]
    assert offline["in_flight"] == in_flight_per_stage(order, 4)
    config = OnlineConfig(schedule="wpipe", micro_batches=3, memory_budget=700_000_000,
                          in_flight=in_flight_per_stage(order, 4), stage_ranks=[0, 1, 0, 1],
                          in_flight_together=in_flight_together(order, 4))
    records = {node.id: SimpleNamespace(param_bytes=node.param_bytes, optimizer_bytes=node.param_bytes)
               for node in graph.nodes}
    ids = [node.id for node in graph.nodes]
    current = Plan(0, (tuple(ids[:3]), tuple(ids[3:5]), tuple(ids[5:8]), tuple(ids[8:])),
                   {lid: Policy.KEEP for lid in ids})
    live = OnlinePlanner(config)._planner(graph, records, current)
    assert live.setup.param_factor(0) - live.setup.param_factor(2) == 1  # G0 two versions, G1 one
    best, _ = srp_loop(GraphProfile(graph), live.setup, live.budgets, live.method)
    assert offline["stages"] == GraphProfile(graph).stages_of(best.cuts)
    assert offline["bottleneck_ms"] == pytest.approx(best.bottleneck_s * 1e3)


# --------------------------------------------------------------------- bad combinations
@pytest.mark.parametrize(("args", "message"), [
    (["--stages-per-rank", "2"],
     "--stages-per-rank is for the multi-stage schedules (interleaved1f1b, loopedbfs, "
                                 "interleavedzb, zbv, dualpipev, wpipe); 1f1b runs one stage per rank"),
    (["--schedule", "gpipe", "--stages-per-rank", "1"], "gpipe runs one stage per rank"),
    (["--schedule", "interleaved1f1b", "--stages-per-rank", "1"],
     "--stages-per-rank must be at least 2 under interleaved1f1b, got 1"),
    (["--schedule", "zbv", "--stages-per-rank", "3"],
     "zbv runs exactly 2 stages per rank (a V), got --stages-per-rank 3"),
    (["--schedule", "wpipe", "--stages-per-rank", "3"],
     "wpipe runs exactly 2 stages per rank (G0's and G1's), got --stages-per-rank 3"),
    (["--schedule", "wpipe", "--micro-batches", "1"],
     "wpipe needs at least as many micro-batches per step as ranks (1 < 2)"),
    (["--schedule", "loopedbfs", "--stages-per-rank", "two"],
     "--stages-per-rank must be an integer, got 'two'"),
    (["--schedule", "dualpipev", "--micro-batches", "2"],
     "torch's ScheduleDualPipeV refuses 2 ranks x 2 stages with 2 micro-batches: DualPipeV "
     "requires at least as many microbatches as stages"),
    (["--schedule", "custom"],
     "--schedule must be one of gpipe, 1f1b, pipedream, pipedream2bw, interleaved1f1b"),
    (["--schedule", "interleaved1f1b", "--stages", "4", "--stages-per-rank", "3"],
     "--stages 4 x --stages-per-rank 3 is more than the graph's 10 layers"),
])
def test_bad_multi_stage_combinations_are_one_line_and_exit_2(capsys, tmp_path, args, message):
    path = tmp_path / "graph.json"
    chain([1.0] * 10).save(path)
    if "--stages" not in args:
        args = [*args, "--stages", "2"]
    code, out, err = plan_command(capsys, str(path), *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("vpipe: error: "), err
    assert message in err


def test_graph_json_plans_print_ranks_for_a_multi_stage_schedule(capsys, tmp_path):
    path = tmp_path / "graph.json"
    chain([1.0] * 8).save(path)
    plan = json_plan(capsys, str(path), "--stages", "2", "--schedule", "loopedbfs", "--stages-per-rank", "3",
                      "--micro-batches", "4")
    assert len(plan["stages"]) == 6 and plan["stage_ranks"] == [0, 1, 0, 1, 0, 1]
    assert json.loads(json.dumps(plan)) == plan and Path(path).exists()


@pytest.mark.parametrize("blocks", [[2, 2, 2], [3, 3], [2, 3, 1], [1, 4, 4, 1], [0, 3, 3, 0], [5], [4, 4],
                                    [3, 2, 2],
                                    [3, 4, 4, 4, 2], [1, 1, 6]])
def test_the_less_layers_fields_are_written_exactly_when_torchtitans_rule_gives_those_blocks(blocks):
    from vpipe.graph import Unit
    from vpipe.planner.formats import torchtitan_form

    n = sum(blocks)
    units = [Unit("tok_embeddings")] + [Unit(f"layers.{i}", "layers") for i in range(n)] + \
        [Unit("norm"), Unit("output")]
    names, stages, at = [u.name for u in units], [], 1
    for k, count in enumerate(blocks):
        stages.append((["tok_embeddings"] if k == 0 else []) + names[at:at + count]
                      + (["norm", "output"] if k == len(blocks) - 1 else []))
        at += count
    titan = torchtitan_form(stages, units, "1f1b", len(blocks), 1)
    first, last = (titan["pipeline_parallel_first_stage_less_layers"],
                   titan["pipeline_parallel_last_stage_less_layers"])

    def gives(a: int, b: int) -> bool:
        try:
            return torchtitan_layers_per_stage(len(blocks), n, a, b) == blocks
        except ValueError:
            return False

    if first is None:
        assert not any(gives(a, b) for a in range(n + 2) for b in range(n + 2))
    else:
        assert gives(first, last)


# --------------------------------------------------------------------- DeepSpeed's partition_method
# (weights, stages) -> the parts DeepSpeed 0.19.8's own partition_balanced returns
# (deepspeed/runtime/utils.py, run on these inputs); its rule minimises the spread
# between stages greedily, prefix by prefix, so ties matter
DEEPSPEED_BALANCED = [
    ([1] * 8, 2, [0, 4, 8]),
    ([1] * 8, 3, [0, 3, 6, 8]),
    ([1, 0, 0, 0, 0, 0, 0, 0, 0, 1], 4, [0, 7, 8, 9, 10]),
    ([5, 2, 2, 2, 2, 2, 2, 2, 2, 9], 2, [0, 6, 10]),
    ([0, 1, 1, 1, 1, 1, 1, 1, 1, 0], 2, [0, 5, 10]),
    ([0, 1, 1, 1, 1, 1, 1, 1, 1, 0], 3, [0, 4, 7, 10]),
    ([4096, 100, 100, 100, 100, 100, 100, 8, 4096], 2, [0, 4, 9]),
]


@pytest.mark.parametrize("weights, stages, parts", DEEPSPEED_BALANCED)
def test_the_balanced_partition_is_deepspeeds_tie_for_tie(weights, stages, parts):
    from vpipe.planner.formats import balanced_bounds, uniform_bounds

    assert balanced_bounds(weights, stages) == parts
    assert uniform_bounds(10, 4) == [0, 3, 6, 8, 10] and uniform_bounds(3, 5) == [0, 1, 2, 3, 3, 3]


def test_the_balanced_partition_matches_an_installed_deepspeed_on_random_weights():
    utils = pytest.importorskip("deepspeed.runtime.utils",
                                reason="DeepSpeed is not installed (the deepspeed extra)")
    import random

    from vpipe.planner.formats import balanced_bounds, uniform_bounds

    rng = random.Random(0)
    for _ in range(500):
        n, m = rng.randint(1, 14), rng.randint(1, 6)
        weights = [rng.choice([0, 1, 2, 3, 5, 100, 4096]) for _ in range(n)]
        assert balanced_bounds(weights, m) == [int(x) for x in utils.partition_balanced(weights, m)]
        assert uniform_bounds(n, m) == [int(x) for x in utils.partition_uniform(n, m)]


def _llama_units(blocks: int) -> list:
    from vpipe.graph import Unit

    return ([Unit("tok_embeddings", kind="Embedding", params=256 * 64)]
            + [Unit(f"layers.{i}", "layers", kind="TransformerBlock", params=49_536) for i in range(blocks)]
            + [Unit("norm", kind="LayerNorm", params=128), Unit("output", kind="Linear", params=64 * 256)])


def _stages(units: list, counts: list[int]) -> list[list[str]]:
    names, out, at = [u.name for u in units], [], 0
    for count in counts:
        out.append(names[at:at + count])
        at += count
    return out


@pytest.mark.parametrize("counts, method", [([4, 2, 4], "type:TransformerBlock"), ([3, 4, 4], None),
                                            ([6, 6], "parameters"), ([5, 5, 1], None),
                                            ([4, 4, 3], "uniform")])
def test_the_deepspeed_method_is_one_whose_rule_gives_the_planned_parts(counts, method):
    from vpipe.planner.formats import balanced_bounds, deepspeed_form, uniform_bounds

    units = _llama_units(sum(counts) - 3)
    form = deepspeed_form(_stages(units, counts), units, "1f1b", 1)
    parts = [sum(counts[:k]) for k in range(len(counts) + 1)]
    assert form["parts"] == parts and form["partition_method"] == method
    rules = {"parameters": balanced_bounds([u.params for u in units], len(counts)),
             "uniform": uniform_bounds(len(units), len(counts)),
             "type:TransformerBlock": balanced_bounds([int(u.container is not None) for u in units],
                                                      len(counts))}
    if method is None:
        assert all(rule != parts for rule in rules.values())
        assert form["notes"] == [f"partition_method: no method gives the planned parts {parts}: "
                                 + "; ".join(f"{m} gives {b}" for m, b in rules.items())]
    else:
        assert rules[method] == parts and form["notes"] == []


def test_deepspeed_gets_no_method_for_several_stages_per_rank_and_a_note_for_another_schedule():
    from vpipe.planner.formats import deepspeed_form

    units = _llama_units(8)
    form = deepspeed_form(_stages(units, [3, 3, 2, 3]), units, "interleaved1f1b", 2)
    assert form["partition_method"] is None
    assert form["notes"] == ["partition_method: DeepSpeed runs one stage per rank, the plan 2"]
    form = deepspeed_form(_stages(units, [4, 4, 3]), units, "gpipe", 1)
    assert form["partition_method"] == "uniform"
    assert form["notes"] == ["schedule: DeepSpeed runs its own 1F1B; the plan was made for gpipe"]


def test_the_table_and_the_json_carry_deepspeeds_partition_method(capsys):
    plan = json_plan(capsys, *TUTORIAL, "--stages", "2")
    form = plan["deepspeed"]
    sizes = [len(s) for s in plan["stages"]]
    assert form["parts"] == [0, sizes[0], sum(sizes)]
    assert form["partition_method"] is not None or form["notes"][0].startswith("partition_method: "
                                                                               "no method gives")
    code, out, _ = plan_command(capsys, *TUTORIAL, "--stages", "2")
    assert code == 0 and [x for x in out.splitlines() if x.startswith("DeepSpeed: ")]
