"""The pipeline simulator's arithmetic: exact on hand-computable cases, calibration on synthetic runs.

The exact cases are closed forms: a flow shop of identical micro-batches (GPipe's
forward then backward phases), PipeDream's bubble-free steady state, and processor
sharing that conserves work. How close it comes to real runs on this machine is a
measurement, not a test: ``benchmarks/simulator_bench.py`` (target: within 15%).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from vpipe_lab.runtime.calibrate import REFERENCE_RUN, calibrate, predict_step_s, typical, validate
from vpipe_lab.runtime.costs import LayerCost, Link, ModelCosts, ideal_step_s, scaled, stage_costs
from vpipe_lab.runtime.simulate import StageCost, action_order, simulate


def flow_shop_s(costs: list[StageCost], m: int) -> float:
    """GPipe step: forward flow shop then backward flow shop of m identical jobs, plus stage 0's update.

    A chain of stages processing m identical jobs in order finishes after the sum of the
    stage times and lags plus (m - 1) times the slowest stage.
    """
    lags = sum(c.send_s for c in costs[:-1])
    fwd = sum(c.fwd_s for c in costs) + lags + (m - 1) * max(c.fwd_s for c in costs)
    bwd = sum(c.bwd_s for c in costs) + lags + (m - 1) * max(c.bwd_s for c in costs)
    return fwd + bwd + costs[0].optimizer_s


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_gpipe_uniform_matches_the_bubble_formula(p, m):
    f, b = 0.010, 0.020
    result = simulate([StageCost(f, b)] * p, schedule="gpipe", micro_batches=m, steps=4)
    assert result.step_s == pytest.approx((m + p - 1) * (f + b))
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("seed", range(5))
def test_gpipe_heterogeneous_stages_match_the_flow_shop_formula(seed):
    rng = random.Random(seed)
    p, m = rng.randint(2, 6), rng.randint(1, 9)
    costs = [StageCost(rng.uniform(1, 5) * 1e-3, rng.uniform(1, 9) * 1e-3, send_s=rng.uniform(0, 1) * 1e-3)
             for _ in range(p)]
    costs[0] = StageCost(costs[0].fwd_s, costs[0].bwd_s, costs[0].send_s, optimizer_s=2e-3)
    result = simulate(costs, schedule="gpipe", micro_batches=m, steps=5)
    assert result.step_s == pytest.approx(flow_shop_s(costs, m))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 12)])
def test_1f1b_uniform_has_the_same_step_as_gpipe(p, m):
    f, b = 0.010, 0.020
    result = simulate([StageCost(f, b)] * p, schedule="1f1b", micro_batches=m, steps=4)
    assert result.step_s == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_pipedream_steady_state_has_no_bubble(p):
    f, b, o = 0.010, 0.020, 0.001
    m = p
    result = simulate([StageCost(f, b, optimizer_s=o)] * p, schedule="pipedream", micro_batches=m, steps=12)
    assert result.step_s == pytest.approx(m * (f + b + o))


def test_pipedream_steady_state_runs_at_the_slowest_stage():
    costs = [StageCost(0.010, 0.020), StageCost(0.015, 0.030), StageCost(0.005, 0.010)]
    result = simulate(costs, schedule="pipedream", micro_batches=3, steps=15)
    assert result.step_s == pytest.approx(3 * 0.045, rel=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
def test_one_core_serialises_all_the_work(schedule):
    """Processor sharing on one core: the pipeline does all stages' work one after another."""
    p, m, f, b = 4, 4, 0.010, 0.020
    result = simulate([StageCost(f, b)] * p, schedule=schedule, micro_batches=m, steps=6, cores=1)
    assert result.step_s == pytest.approx(p * m * (f + b))


def test_two_cores_for_two_stages_change_nothing():
    costs = [StageCost(0.010, 0.020), StageCost(0.012, 0.018)]
    alone = simulate(costs, schedule="1f1b", micro_batches=4, steps=4)
    shared = simulate(costs, schedule="1f1b", micro_batches=4, steps=4, cores=2)
    assert shared.step_s == pytest.approx(alone.step_s)


def test_processor_sharing_halves_the_rate_of_two_concurrent_actions():
    """Two stages whose forwards overlap on one core: the pair takes twice as long as one."""
    costs = [StageCost(0.010, 0.0), StageCost(0.010, 0.0)]
    shared = simulate(costs, schedule="gpipe", micro_batches=2, steps=1, cores=1)
    # F0@s0 [0,10] alone; F1@s0 and F0@s1 share [10,30]; F1@s1 alone [30,40]
    assert shared.total_s == pytest.approx(0.040)
    assert sum(shared.busy_s) == pytest.approx(0.040)


def test_background_load_takes_its_share_of_the_cores():
    """One stage on one core beside one always-busy outside thread runs at half speed."""
    alone = simulate([StageCost(0.010, 0.020)], schedule="gpipe", micro_batches=4, steps=4, cores=1)
    shared = simulate([StageCost(0.010, 0.020)], schedule="gpipe", micro_batches=4, steps=4, cores=1,
                      background=1.0)
    assert shared.step_s == pytest.approx(2 * alone.step_s)
    # two cores and one outside thread: alone a stage gets a whole core, two computing stages 2/3 each
    # F0@s0 [0,10] alone; F1@s0 and F0@s1 together [10,25]; F1@s1 alone [25,35]
    two = simulate([StageCost(0.010, 0.0)] * 2, schedule="gpipe", micro_batches=2, steps=1, cores=2,
                   background=1.0)
    assert two.total_s == pytest.approx(0.035)
    with pytest.raises(ValueError, match="background load"):
        simulate([StageCost(1, 1)], schedule="gpipe", micro_batches=1, background=-1)


def test_migration_stall_delays_every_later_step():
    costs = [StageCost(0.010, 0.020)] * 2
    plain = simulate(costs, schedule="gpipe", micro_batches=4, steps=4)
    stalled = simulate(costs, schedule="gpipe", micro_batches=4, steps=4, stall_s=[0, 0, 0.050, 0])
    assert stalled.total_s == pytest.approx(plain.total_s + 0.050)


def test_action_orders_are_the_schedules_orders():
    assert action_order("gpipe", 0, 2, 2, 1) == [("F", 0), ("F", 1), ("B", 0), ("B", 1), ("O", 1)]
    assert action_order("1f1b", 0, 2, 3, 1) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2),
                                                ("O", 2)]
    assert action_order("1f1b", 1, 2, 3, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                                                ("O", 2)]
    assert action_order("pipedream", 1, 2, 2, 1) == [("F", 0), ("B", 0), ("O", 0), ("F", 1), ("B", 1),
                                                     ("O", 1)]


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="micro_batches >= stages"):
        simulate([StageCost(1, 1)] * 4, schedule="1f1b", micro_batches=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        simulate([StageCost(1, 1)], schedule="zb", micro_batches=2)
    with pytest.raises(ValueError, match="finite"):
        StageCost(float("nan"), 1)



# ---------------------------------------------------------------------- uneven devices (stage_speeds)
def _random_costs(rng: random.Random, p: int) -> list[StageCost]:
    return [StageCost(rng.uniform(1, 5) * 1e-3, rng.uniform(1, 9) * 1e-3, send_s=rng.uniform(0, 1) * 1e-3,
                      optimizer_s=rng.uniform(0, 1) * 1e-3) for _ in range(p)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
@pytest.mark.parametrize("cores", [None, 1])
def test_speeds_of_one_reproduce_the_plain_simulation_exactly(schedule, cores):
    rng = random.Random(7)
    costs = _random_costs(rng, 4)
    plain = simulate(costs, schedule=schedule, micro_batches=6, steps=4, cores=cores, stall_s=[0, 0.002])
    ones = simulate(costs, schedule=schedule, micro_batches=6, steps=4, cores=cores, stall_s=[0, 0.002],
                    stage_speeds=[1.0, 1, 1.0, 1])
    assert ones == plain  # every field bit for bit, not approximately


@pytest.mark.parametrize("m", [2, 4, 8])
def test_1f1b_two_stages_with_the_last_twice_as_slow_matches_its_closed_form(m):
    """Stage 1 is busy without a gap from its first forward to its last backward;
    around that, stage 0's first forward and last backward, a transfer each way and
    stage 0's update (stage 1's hides under that backward)."""
    f, b, send, opt = 0.010, 0.020, 0.001, 0.003
    result = simulate([StageCost(f, b, send_s=send, optimizer_s=opt)] * 2, schedule="1f1b", micro_batches=m,
                      steps=4, stage_speeds=[1.0, 2.0])
    assert result.step_s == pytest.approx(f + b + 2 * send + m * 2 * (f + b) + opt)
    assert result.busy_s[1] == pytest.approx(2 * result.busy_s[0])


@pytest.mark.parametrize("seed", range(5))
def test_speeds_scale_compute_and_leave_transfers_alone(seed):
    """GPipe's flow-shop closed form on the costs scaled by hand: only forward, backward and update grow."""
    rng = random.Random(seed)
    p, m = rng.randint(2, 6), rng.randint(1, 9)
    costs = _random_costs(rng, p)
    speeds = [rng.choice([0.5, 1.0, 1.5, 3.0]) for _ in range(p)]
    by_hand = [StageCost(c.fwd_s * v, c.bwd_s * v, send_s=c.send_s, optimizer_s=c.optimizer_s * v)
               for c, v in zip(costs, speeds)]
    result = simulate(costs, schedule="gpipe", micro_batches=m, steps=5, stage_speeds=speeds)
    assert result.step_s == pytest.approx(flow_shop_s(by_hand, m))
    assert result == simulate(by_hand, schedule="gpipe", micro_batches=m, steps=5)


def test_pipedream_with_one_slow_stage_runs_at_that_stage_update_included():
    f, b, o = 0.010, 0.020, 0.002
    result = simulate([StageCost(f, b, optimizer_s=o)] * 3, schedule="pipedream", micro_batches=3, steps=15,
                      stage_speeds=[1.0, 1.5, 1.0])
    assert result.step_s == pytest.approx(3 * 1.5 * (f + b + o), rel=1e-6)


def test_the_same_factor_everywhere_scales_a_pipeline_without_transfers():
    costs = _random_costs(random.Random(3), 4)
    costs = [StageCost(c.fwd_s, c.bwd_s, optimizer_s=c.optimizer_s) for c in costs]
    plain = simulate(costs, schedule="1f1b", micro_batches=8, steps=4)
    slow = simulate(costs, schedule="1f1b", micro_batches=8, steps=4, stage_speeds=[2.5] * 4)
    assert slow.step_s == pytest.approx(2.5 * plain.step_s)
    assert slow.bubble_fraction == pytest.approx(plain.bubble_fraction)


@pytest.mark.parametrize("speeds,message", [
    ([1.0], "one factor per stage: 1 for 2 stages"),
    ([1.0, 1.0, 1.0], "one factor per stage: 3 for 2 stages"),
    ([1.0, 0.0], "positive finite numbers, got 0.0 for stage 1"),
    ([-1.5, 1.0], "positive finite numbers, got -1.5 for stage 0"),
    ([1.0, float("nan")], "got nan for stage 1"),
    ([float("inf"), 1.0], "got inf for stage 0"),
    ([True, 1.0], "got True for stage 0"),
    ([1.0, "2"], "got '2' for stage 1"),
])
def test_bad_speeds_are_clear_errors(speeds, message):
    with pytest.raises(ValueError, match=message):
        simulate([StageCost(1, 1)] * 2, schedule="gpipe", micro_batches=2, stage_speeds=speeds)


# ---------------------------------------------------------------------- stage costs from layer costs
def _costs(n: int = 4) -> ModelCosts:
    layers = [LayerCost(fwd_s=0.001 * (i + 1), bwd_s=0.002 * (i + 1), act_bytes=1_000_000, input_bytes=1000,
                        param_bytes=4000, out_bytes=8000, opt_s=0.0001) for i in range(n)]
    return ModelCosts(model="toy", micro_batch_size=2, layers=layers, loss_fwd_s=0.0005, loss_bwd_s=0.0005,
                      batch_s=0.0002)


def test_stage_costs_add_recompute_swap_loss_and_updates():
    costs = _costs()
    link = Link(send_bytes_per_s=8e6, swap_bytes_per_s=1e9, overlap=0.0)
    plain = stage_costs(costs, [2, 2], link=link)
    assert plain[0].fwd_s == pytest.approx(0.003) and plain[0].bwd_s == pytest.approx(0.006)
    assert plain[1].fwd_s == pytest.approx(0.007 + 0.0005) and plain[1].bwd_s == pytest.approx(0.014 + 0.0005)
    assert plain[0].send_s == pytest.approx(0.001) and plain[1].send_s == 0
    assert plain[0].optimizer_s == pytest.approx(0.0002 + 0.0002)  # two layers' updates + the input batch
    recompute = stage_costs(costs, [2, 2], link=link, policies={0: "R"})
    assert recompute[0].bwd_s == pytest.approx(0.006 + 0.001)
    swap = stage_costs(costs, [2, 2], link=link, policies={1: "S"})
    assert swap[0].bwd_s == pytest.approx(0.006 + 2e6 / 1e9)
    hidden = stage_costs(costs, [2, 2], link=Link(swap_bytes_per_s=1e9, overlap=1.0), policies={1: "S"})
    assert hidden[0].bwd_s == pytest.approx(0.006)  # 2 ms of copies under 9 ms of compute
    with pytest.raises(ValueError, match="policy"):
        stage_costs(costs, [2, 2], policies={0: "X"})
    with pytest.raises(ValueError, match="counts"):
        stage_costs(costs, [3, 2])


def test_ideal_is_the_compute_split_evenly():
    costs = _costs()
    assert ideal_step_s(costs, 2, 4) == pytest.approx(4 * costs.compute_s / 2)
    assert ideal_step_s(costs, 4, 4, cores=2) == pytest.approx(4 * costs.compute_s / 2)


def _synthetic_point(size: int, overhead: float = 0.003, scale: float = 1.3, noise: float = 1.0):
    """Runs made by the simulator itself with a known overhead and scale, under different outside loads."""
    cfg = dataclasses.replace(REFERENCE_RUN, stages=2, micro_batch_size=size)
    # compute grows with the micro-batch, overheads do not
    costs = scaled(_costs(REFERENCE_RUN.n_layers), size)
    runs = [(noise * predict_step_s(cfg, scaled(costs, scale), action_overhead_s=overhead, background=load),
             load)
            for load in (0.0, 0.5, 2.0)]
    return cfg, costs, runs


def test_calibration_recovers_the_overhead_and_compute_scale_that_made_the_runs():
    for sizes in ((1, 4), (1, 4, 16)):
        found = calibrate(*(_synthetic_point(size) for size in sizes))
        assert found.action_overhead_s == pytest.approx(0.003, rel=1e-3), sizes
        assert found.compute_scale == pytest.approx(1.3, rel=1e-3), sizes


def test_calibration_on_three_sizes_spreads_one_noisy_run():
    """A size-4 run 10% slow: an exact solve through sizes 1 and 4 carries the whole error into the scale;
    the least-squares fit over 1, 4 and 16 keeps the scale closer to the truth."""
    noisy = _synthetic_point(4, noise=1.10)
    two = calibrate(_synthetic_point(1), noisy)
    three = calibrate(_synthetic_point(1), noisy, _synthetic_point(16))
    assert abs(three.compute_scale - 1.3) < abs(two.compute_scale - 1.3)
    with pytest.raises(ValueError, match="two or more micro-batch sizes"):
        calibrate(_synthetic_point(1))


def test_typical_profile_is_the_median_round_per_layer_so_one_slow_moment_moves_nothing():
    """Three rounds of the same profile, one taken while the machine was slow on one
    layer and another while it was fast on the loss: the typical profile is the
    middle round everywhere, unlike the fastest or the mean."""
    base = _costs()
    slow_layer = dataclasses.replace(base, layers=[dataclasses.replace(base.layers[0], fwd_s=0.010,
                                                                       bwd_s=0.030),
                                                   *base.layers[1:]])
    fast_loss = dataclasses.replace(scaled(base, 1.1), loss_fwd_s=0.0001)
    middle = typical([slow_layer, base, fast_loss])
    assert middle.layers[0].fwd_s == pytest.approx(1.1 * base.layers[0].fwd_s)  # of 10, 1 and 1.1 ms
    assert middle.layers[0].bwd_s == pytest.approx(1.1 * base.layers[0].bwd_s)
    assert middle.layers[1:] == base.layers[1:]  # two rounds at the base times, one 10% slower
    assert middle.loss_fwd_s == pytest.approx(base.loss_fwd_s)
    assert middle.layers[0].act_bytes == base.layers[0].act_bytes
    with pytest.raises(ValueError, match="one model at one micro-batch size"):
        typical([base, dataclasses.replace(base, micro_batch_size=4)])
    with pytest.raises(ValueError, match="at least one profile"):
        typical([])


def test_validation_predicts_another_depth_with_a_given_calibration(monkeypatch):
    """The calibration of 2 stages carried to 4: only the 4-stage run is made, and the prediction is the
    simulator's with that overhead and scale (runs here are simulated, so it is exact)."""
    from vpipe_lab.runtime import calibrate as calibration_module
    from vpipe_lab.runtime.calibrate import Calibration

    cfg = dataclasses.replace(REFERENCE_RUN, stages=4, micro_batch_size=8)
    costs = scaled(_costs(REFERENCE_RUN.n_layers), 8)
    truth = predict_step_s(cfg, scaled(costs, 1.3), action_overhead_s=0.003)
    made: list[tuple[int, int]] = []

    def fake_measure(run_cfg):
        made.append((run_cfg.stages, run_cfg.micro_batch_size))
        return truth, 0.0

    monkeypatch.setattr(calibration_module, "_measure_run", fake_measure)
    prediction = validate(cfg, repeats=2, profiles={8: costs}, calibrated_on_stages=2,
                          calibration=Calibration(action_overhead_s=0.003, compute_scale=1.3))
    assert made == [(4, 8), (4, 8)]
    assert prediction.error == pytest.approx(0.0, abs=1e-9)
    assert prediction.calibrated_on_stages == 2 and prediction.calibration.compute_scale == 1.3


def test_validation_profiles_every_size_after_each_run_and_shares_them_with_the_next_depth(monkeypatch):
    """The profiles see the machine at as many moments as the runs: one round of
    every size after each real run, combined by their median; the dict passed in is
    filled, and a second depth given it profiles nothing."""
    from vpipe_lab.runtime import calibrate as calibration_module

    cfg = dataclasses.replace(REFERENCE_RUN, stages=2, micro_batch_size=8)
    events: list[tuple[str, int]] = []
    # each size: one round as it is, one at a fast moment, one at a slow
    slowdown = iter([1.0, 0.5, 3.0] * 100)

    def fake_run(run_cfg):
        events.append(("run", run_cfg.micro_batch_size))
        return predict_step_s(run_cfg, scaled(_costs(REFERENCE_RUN.n_layers), run_cfg.micro_batch_size)), 0.0

    def fake_profile(run_cfg, rounds):
        events.append(("profile", run_cfg.micro_batch_size))
        return scaled(dataclasses.replace(_costs(REFERENCE_RUN.n_layers),
                                          micro_batch_size=run_cfg.micro_batch_size),
                      run_cfg.micro_batch_size * next(slowdown))

    monkeypatch.setattr(calibration_module, "_measure_run", fake_run)
    monkeypatch.setattr(calibration_module, "measure_model_costs", fake_profile)
    shared: dict[int, ModelCosts] = {}
    first = validate(cfg, repeats=3, profiles=shared)
    sizes = [1, 4, 16, 8]
    assert events == [event for _ in range(3) for size in sizes
                      for event in [("run", size), *(("profile", s) for s in sizes)]]
    assert sorted(shared) == [1, 4, 8, 16]
    # the median of the three rounds: neither the fastest nor the slowest
    for size, profile in shared.items():
        assert profile.layers == scaled(_costs(REFERENCE_RUN.n_layers), size).layers
    assert first.error == pytest.approx(0.0, abs=1e-3)
    events.clear()
    second = validate(dataclasses.replace(cfg, stages=4), repeats=2, profiles=shared,
                      calibration=first.calibration,
                      calibrated_on_stages=2)
    assert events == [("run", 8), ("run", 8)]  # the first depth's profiles, not new ones
    assert second.calibrated_on_stages == 2
