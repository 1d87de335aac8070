"""Cost model: schedules' in-flight counts, stage time and memory rules, boundary bytes, step time."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from support.graphs import boundary_bytes_by_definition, chain, dags
from vpipe.graph import LayerGraph, LayerNode
from vpipe.plan import Policy
from vpipe.planner.cost_model import (
    Code,
    GraphProfile,
    Hardware,
    PipelineSetup,
    StageCosts,
    in_flight,
    pipeline_step_time,
    stage_memory,
    stage_time,
    throughput,
    weight_versions,
)
from vpipe.planner.sr import optimize_segment

D, S, R = Policy.KEEP, Policy.SWAP, Policy.RECOMPUTE


def test_in_flight_and_weight_versions_follow_the_schedule():
    # GPipe holds every micro-batch; 1F1B p - k (capped by m); PipeDream p - k activations and weights
    assert [in_flight("gpipe", k, 4, 8) for k in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", k, 4, 8) for k in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", k, 4, 2) for k in range(4)] == [2, 2, 2, 1]
    assert [in_flight("pipedream", k, 4, 2) for k in range(4)] == [4, 3, 2, 1]
    assert [weight_versions("pipedream", k, 4) for k in range(4)] == [4, 3, 2, 1]
    assert [weight_versions("1f1b", k, 4) for k in range(4)] == [1, 1, 1, 1]
    # PipeDream-2BW: PipeDream's activations, two weight versions on every stage (the WPipe paper's Table 1)
    assert [in_flight("pipedream2bw", k, 4, 8) for k in range(4)] == [4, 3, 2, 1]
    assert [weight_versions("pipedream2bw", k, 4) for k in range(4)] == [2, 2, 2, 2]
    # WPipe on 2 ranks: 4 virtual stages, G0's (0, 1) two weight versions, G1's (2, 3) one (Table 1 again);
    # its in-flight counts come from the lists the schedule writes, as for torch's multi-stage schedules
    assert [weight_versions("wpipe", k, 4) for k in range(4)] == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="wpipe runs several stages per rank"):
        in_flight("wpipe", 0, 4, 8)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        in_flight("zb", 0, 4, 8)


def test_a_schedule_is_one_row_of_the_rules_and_the_planner_prices_it(monkeypatch):
    """A new one-stage-per-rank schedule needs no branch in the cost model: a row gives its in-flight count,
    weight versions and whether it streams, and the setup, the step time and the memory follow from it."""
    from vpipe.planner import setup

    row = setup.ScheduleRules(streams=True, in_flight=lambda k, p, m: 1, versions=lambda k, p: 3)
    monkeypatch.setitem(setup.RULES, "onebatch", row)
    pipeline = PipelineSetup(num_stages=3, schedule="onebatch", micro_batches=4)
    assert [pipeline.in_flight(k) for k in range(3)] == [1, 1, 1]
    assert weight_versions("onebatch", 1, 3) == 3 and setup.streams("onebatch") and not setup.streams("1f1b")
    assert pipeline.step_time([1.0, 2.0, 1.5]) == 4 * 2.0  # a stream: no bubble
    assert pipeline_step_time([1.0, 2.0, 1.5], "1f1b", 4) == 4.5 + 3 * 2.0


def _two_layers() -> LayerGraph:
    nodes = [LayerNode(10, "a", 1e-3, 2e-3, 100, 1000, 0), LayerNode(20, "b", 3e-3, 6e-3, 400, 10, 1)]
    return LayerGraph("two", nodes, [(10, 20, 50)])


def test_stage_time_adds_recompute_forward_and_only_the_swap_the_link_cannot_hide():
    g = _two_layers()
    assert stage_time(g, [10, 20]) == pytest.approx(12e-3)
    assert stage_time(g, [10, 20], {20: R}) == pytest.approx(15e-3)  # + layer b's forward
    # swap of b moves 2 * 400 bytes; hidden while the link is faster than the 12 ms of compute
    assert stage_time(g, [10, 20], {20: S}, Hardware(copy_bytes_per_s=1e6)) == pytest.approx(12e-3)
    # at 50 kB/s the copy takes 16 ms: 4 ms is exposed
    assert stage_time(g, [10, 20], {20: S}, Hardware(copy_bytes_per_s=5e4)) == pytest.approx(16e-3)


def test_on_a_cpu_a_swaps_copies_add_to_the_compute_they_run_on():
    g = _two_layers()
    cpu = Hardware(copy_bytes_per_s=1e6, copies_overlap=False)
    assert stage_time(g, [10, 20], {20: S}, cpu) == pytest.approx(12e-3 + 0.8e-3)  # 800 bytes at 1 MB/s
    assert stage_time(g, [10, 20], {}, cpu) == pytest.approx(12e-3)
    # the policy search prices it the same way: with memory to spare nothing is
    # swapped, and under a budget that one swap or one recompute meets, the cheaper one
    # is chosen (b's 3 ms forward against its 0.8 ms copy)
    profile = GraphProfile(g)
    for hardware, cheaper in ((cpu, Code.S), (Hardware(copy_bytes_per_s=1e5, copies_overlap=False), Code.R)):
        setup = PipelineSetup(1, "gpipe", 4, hardware)  # 3 x 1010 parameter bytes + 4 x 500 activations kept
        assert list(optimize_segment(profile, setup, 0, 2, 0, budget=1e9).codes) == [Code.D, Code.D]
        # only b's swap or recompute saves it
        tight = optimize_segment(profile, setup, 0, 2, 0, budget=5030 - 1000)
        assert tight.fits and list(tight.codes) == [Code.D, cheaper]


def test_stage_time_charges_boundary_tensors_to_the_receiving_stage():
    g = _two_layers()
    hw = Hardware(net_bytes_per_s=1e4)  # 50 bytes take 5 ms
    assert stage_time(g, [10], hardware=hw) == pytest.approx(3e-3 + 5e-3)  # gradient of its output
    assert stage_time(g, [20], hardware=hw) == pytest.approx(9e-3 + 5e-3)  # its input


def test_stage_memory_counts_params_optimizer_versions_and_in_flight_activations():
    g = _two_layers()
    kw = dict(stage=0, num_stages=4, micro_batches=8)
    # 1F1B stage 0: 4 in flight; Adam: params x (1 + 2)
    assert stage_memory(g, [10, 20], schedule="1f1b", **kw) == 1010 * 3 + 4 * 500
    assert stage_memory(g, [10, 20], schedule="gpipe", **kw) == 1010 * 3 + 8 * 500
    # PipeDream stage 0 stashes 4 weight versions (optimizer state once)
    assert stage_memory(g, [10, 20], schedule="pipedream", **kw) == 1010 * (4 + 2) + 4 * 500
    # S keeps one copy of b, R keeps b's input (50 bytes) per in-flight micro-batch
    assert stage_memory(g, [10, 20], {20: S}, schedule="1f1b", **kw) == 1010 * 3 + 4 * 100 + 400
    assert stage_memory(g, [10, 20], {20: R}, schedule="1f1b", **kw) == 1010 * 3 + 4 * (100 + 50)
    assert stage_memory(g, [10, 20], schedule="1f1b", hardware=Hardware(optimizer_factor=0),
                        **kw) == 1010 + 2000


def test_public_helpers_reject_non_contiguous_stages_and_bad_hardware():
    g = chain([1.0] * 4)
    with pytest.raises(ValueError, match="contiguous"):
        stage_time(g, [g.ids[0], g.ids[2]])
    with pytest.raises(ValueError, match="outside 0..3"):
        stage_memory(g, g.ids, stage=4, num_stages=4)
    with pytest.raises(ValueError, match="net_bytes_per_s must be a positive"):
        Hardware(net_bytes_per_s=0)
    with pytest.raises(ValueError, match="optimizer_factor"):
        Hardware(optimizer_factor=-1)
    with pytest.raises(ValueError, match="budget of stage 1 must be a non-negative"):
        PipelineSetup(2).budgets([5, -1])
    with pytest.raises(ValueError, match="got 3 memory budgets for 2 stages"):
        PipelineSetup(2).budgets([5, 5, 5])


def test_step_time_includes_the_bubble_for_flush_schedules_only():
    times = [1.0, 2.0, 1.5]
    assert pipeline_step_time(times, "gpipe", 8) == pytest.approx(4.5 + 7 * 2.0)
    assert pipeline_step_time(times, "1f1b", 8) == pytest.approx(4.5 + 7 * 2.0)
    assert pipeline_step_time(times, "pipedream", 8) == pytest.approx(16.0)
    assert throughput(times, "pipedream", 8) == pytest.approx(0.5)
    assert pipeline_step_time(times, "pipedream2bw", 8) == pytest.approx(16.0)  # no flush either
    # WPipe: rank 0 runs stages 0 and 2 (2.5 a micro-batch), rank 1 stages 1 and 3; G1's fill and drain once
    assert pipeline_step_time([1.0, 2.0, 1.5, 0.5], "wpipe", 8, (0, 1, 0, 1)) == pytest.approx(8 * 2.5 + 2.0)


def test_a_tensor_crosses_a_boundary_once_however_many_layers_consume_it():
    nodes = [LayerNode(i, f"n{i}", 0, 0, 0, 0, i) for i in range(5)]
    # node 0's output feeds 1, 3 and 4 (a mask, say); node 2 feeds 4 with a bigger tensor
    g = LayerGraph("fan", nodes, [(0, 1, 10), (0, 3, 10), (0, 4, 10), (1, 2, 7), (2, 3, 5), (2, 4, 8)])
    cut = GraphProfile(g).cut
    assert list(cut) == [0, 10, 17, 18, 18, 0]  # not 20 at boundary 2: 0's tensor is sent once


@settings(max_examples=60, deadline=None)
@given(dags(max_nodes=10))
def test_boundary_bytes_match_their_definition(graph):
    np.testing.assert_allclose(GraphProfile(graph).cut, boundary_bytes_by_definition(graph))


@settings(max_examples=40, deadline=None)
@given(dags(max_nodes=9))
def test_segment_queries_agree_with_the_public_helpers(graph):
    profile = GraphProfile(graph)
    rng = np.random.default_rng(len(graph))
    codes = rng.integers(0, 3, profile.n).astype(np.int8)
    policies = profile.policies_from(codes)
    setup = PipelineSetup(3, "pipedream", 4)
    costs = StageCosts(profile, setup, codes)
    n = profile.n
    for i in range(n):
        for j in range(i + 1, n + 1):
            ids = profile.ids[i:j]
            assert costs.time(i, j) == pytest.approx(stage_time(graph, ids, policies))
            for k in range(3):
                assert costs.memory(i, j, k) == pytest.approx(
                    stage_memory(graph, ids, policies, stage=k, num_stages=3, schedule="pipedream",
                                 micro_batches=4))
                assert costs.best_case_memory(i, j, k) <= costs.memory(i, j, k) * (1 + 1e-12) + 1e-6


# ---------------------------------------------------------------------- several stages per rank
def test_a_rank_running_several_stages_pays_for_all_of_them_and_the_bubble_shrinks_with_zero_bubble():
    times = [1.0, 2.0, 1.0, 1.0]  # stages 0..3 on ranks 0, 1, 0, 1 (interleaved) or 0, 1, 1, 0 (V)
    looped = pipeline_step_time(times, "interleaved1f1b", 4, stage_ranks=[0, 1, 0, 1])
    assert looped == 4 * 3.0 + (2 - 1) * 2.0  # rank 1 runs 2 + 1 per micro-batch; one fill/drain of 2
    v_shaped = pipeline_step_time(times, "zbv", 4, stage_ranks=[0, 1, 1, 0])
    assert v_shaped == pytest.approx(4 * 3.0 + 2.0 / 3)
    with pytest.raises(ValueError, match="interleaved1f1b needs the rank of each of its 4 stages"):
        pipeline_step_time(times, "interleaved1f1b", 4)


def test_virtual_stages_take_their_in_flight_counts_from_the_schedule_and_share_their_rank_budget():
    setup = PipelineSetup(4, "interleaved1f1b", 4, in_flight_counts=(4, 3, 2, 1), stage_ranks=(0, 1, 0, 1))
    assert [setup.in_flight(k) for k in range(4)] == [4, 3, 2, 1]
    assert list(setup.budgets(8e9)) == [4e9] * 4  # two stages per rank: half the rank's budget each
    assert setup.step_time([1.0, 1.0, 1.0, 1.0]) == 4 * 2.0 + 1.0
    with pytest.raises(ValueError,
                       match="zbv runs several stages per rank: give in_flight_counts and stage_ranks"):
        PipelineSetup(4, "zbv", 4)
    with pytest.raises(ValueError,
                       match="in_flight_counts must give a non-negative integer for each of the 4"):
        PipelineSetup(4, "zbv", 4, in_flight_counts=(1, 2), stage_ranks=(0, 1, 1, 0))
