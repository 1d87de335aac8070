"""The differential fuzzer (tests/fuzz/): its draws, and a fixed sample of them run with and without vpipe.

The draw tests are quick and run in the default suite. The sample (20 seeds that together take
every value of every axis, up to five of them on 4 ranks: FSDP2, data-parallel and tensor-parallel
draws) trains real pipelines for about three minutes on 2 shared cores (30 s more for each draw
that fails on one rank): it is marked slow. A
failure names each failing seed, what it drew, and the command that runs it again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fuzz.constraints import Unsupported, violations
from fuzz.draws import AXES, FSDP_FUSED, FUSED, PIPEDREAM, Draw, covering_seeds, draw, override, stage_blocks

SAMPLE = covering_seeds(20)


def _values(draws: list[Draw]) -> dict[str, set]:
    return {axis: {getattr(d, axis) for d in draws} for axis in AXES}


def test_a_seed_always_draws_the_same_trainer_and_its_json_gives_it_back():
    for seed in range(50):
        d = draw(seed)
        assert draw(seed) == d
        assert Draw.from_json(d.to_json()) == d
        assert json.loads(d.to_json())["seed"] == seed
        assert "\n" not in d.describe() and f"seed={seed} " in d.describe()
    assert len({draw(seed) for seed in range(50)}) == 50


def test_300_seeds_take_every_value_of_every_axis():
    seen = _values([draw(seed) for seed in range(300)])
    for axis, values in AXES.items():
        assert seen[axis] == set(values), axis


def test_draws_keep_their_constraints():
    for seed in range(300):
        d = draw(seed)
        assert sum(d.counts) == d.layers and all(d.counts) and len(d.counts) == d.num_stages
        if d.moves == "planner":  # vpipe's planner chooses every move: nothing forced, nothing removed
            assert not d.plans and not d.nas_remove and d.ranks == 2
        assert len(d.policies) == d.layers and not (d.nas_add and d.nas_remove)
        steps = [at for at, _, _ in d.plans]
        assert steps == sorted(set(steps)) and all(1 <= at < d.steps for at in steps)
        for at, counts, policies in d.plans:
            removed = bool(d.nas_remove) and at >= d.nas_remove[0]
            added = bool(d.nas_add) and at >= d.nas_add[0]
            assert sum(counts) == d.layers - removed + added and all(counts) and len(counts) == d.num_stages
            assert set(policies) <= set("DSR") and len(policies) == d.layers + added
            order = [i for i in range(d.layers) if not removed or i != d.nas_remove[1]]
            if added:  # the new block (id ``layers``) stands before its position
                order.insert(d.nas_add[1], d.layers)
            assert sum(d.plan_stages(at, counts), []) == order
        if d.nas_remove:
            assert not d.fsdp and d.nas_remove[1] not in d.pinned and 1 <= d.nas_remove[0] < d.steps
        if d.nas_add:
            assert not (d.impl == "fused" and d.optimizer == "sgd")
            assert not d.fsdp and 1 <= d.nas_add[0] < d.steps and 0 <= d.nas_add[1] <= d.layers
        assert d.impl != "fused" or d.optimizer in (FSDP_FUSED if d.fsdp else FUSED)
        assert d.steps % d.accum == 0
        assert d.fsdp == (seed % 10 == 9) and (d.mesh != "") == (d.ranks == 4)
        assert (d.dp != "none") == (seed % 10 == 4) and not (d.dp == "zero" and d.extra == "muon")
        assert not ((d.fsdp or d.schedule == "zbv") and d.block_state == "tied")
        if d.block_state == "tied":  # the tied pair starts on one stage
            assert any(set(d.pinned) <= set(ids) for ids in stage_blocks(d.counts))
        assert bool(d.pinned) == (d.block_state in ("tied", "hook"))
        assert not (d.clip == "global" and (d.block_state == "batchnorm" or d.shape == "mixed"
                                            or d.extra == "muon"))
        assert (d.scaler == "skips") == bool(d.inf_steps)
        assert not (d.impl == "fused" and d.optimizer == "sgd" and d.inf_steps and min(d.inf_steps) < d.accum)
        assert all(0 <= s < d.steps for s in d.inf_steps) and len(d.inf_steps) <= 2
        # the schedule owns the optimizer steps; PipeDream's own delay depends on the split
        if d.schedule in PIPEDREAM:
            assert d.accum == 1 and d.clip == d.lr_scheduler == d.scaler == d.extra == "none" and d.ranks == 2
            assert not d.nas_add and not d.nas_remove and d.block_state != "batchnorm" and d.moves == "forced"
            assert not d.plans if d.schedule == "pipedream" else 1 <= len(d.plans) <= 2
            steps = [at for at, _, _ in d.plans]
            assert all(b - a >= 3 for a, b in zip(steps, steps[1:]))
        elif d.moves == "forced":
            assert 2 <= len(d.plans) <= 4
        assert not (d.compiled == "wrap" and d.schedule == "zbv")
        assert (d.tp != "none") == (seed % 20 == 7 and not d.fsdp) and (d.tp != "none") == ("tp" in d.mesh)
        assert not violations(d), (seed, violations(d))
        assert (d.engine == "deepspeed") == (seed % 20 == 17 and not d.fsdp)
        if d.engine == "deepspeed":  # DeepSpeed's uniform partition of the blocks, its own 1F1B
            assert d.shape == "sequential" and d.schedule == "1f1b" and d.ranks == 2
            assert 2 <= len(d.plans) <= 4
            assert d.counts == (d.layers // 2, d.layers - d.layers // 2) and d.block_state != "tied"
        if d.tp != "none":  # one pipeline on a (pp, tp) mesh: what DTensor blocks and their trainer support
            assert d.ranks == 4 and d.dp == "none" and d.moves == "forced" and d.block_state != "tied"
            assert d.impl == "forloop" and d.clip == d.compiled == d.scaler == d.extra == "none"
            assert d.weights == "plain" and d.schedule not in PIPEDREAM


def test_a_forced_value_brings_its_own_constraints_or_is_refused_in_one_line():
    """``run.py --set schedule=2bw`` used to keep the seed's accumulation, clipping and LR scheduler, which
    2BW's draws never have, and errored on every seed: the value's constraints now apply as when drawn."""
    for value in ("schedule=2bw", "schedule=pipedream", "tp=mlp", "engine=deepspeed", "dp=allreduce",
                  "schedule=zbv"):
        axis, _, forced = value.partition("=")
        ran = 0
        for seed in range(40):
            try:
                d = override(draw(seed), [value])
            except Unsupported as e:  # a seed that cannot take it: one line naming seed, value and why
                assert str(e).startswith(f"seed {seed} with {value}: ") and "\n" not in str(e)
                continue
            assert str(getattr(d, axis)) == forced and not violations(d), (value, seed)
            ran += 1
        assert ran >= 25, value
    assert override(draw(0), ["scaler=skips"]).inf_steps and not override(draw(0), ["scaler=none"]).inf_steps
    two_bw = override(draw(0), ["schedule=2bw"])
    assert two_bw.accum == 1 and two_bw.shape == "sequential" and 1 <= len(two_bw.plans) <= 2
    with pytest.raises(Unsupported, match="one of fsdp, dp, tp and engine=deepspeed"):
        override(draw(9), ["tp=mlp"])  # seed 9 is an FSDP2 draw
    with pytest.raises(ValueError, match="unknown axis"):
        override(draw(0), ["nonsense=1"])


def test_run_refuses_a_forced_value_no_seed_can_take_in_one_line(capsys):
    from fuzz.run import main

    with pytest.raises(SystemExit):
        main(["--only", "9", "--set", "tp=mlp"])
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("not run: seed 9 with tp=mlp: one of fsdp, dp, tp")
    assert "combines with none of the seeds" in err


def test_the_ci_sample_takes_every_value_of_every_axis_with_few_four_rank_draws():
    draws = [draw(seed) for seed in SAMPLE]
    assert 16 <= len(SAMPLE) <= 24
    assert sum(d.fsdp for d in draws) >= 1 and sum(d.ranks == 4 for d in draws) <= 5
    seen = _values(draws)
    for axis, values in AXES.items():
        assert seen[axis] == set(values), axis


@pytest.mark.slow  # about 180 s on 2 cores shared with other work
@pytest.mark.timeout(900)
def test_a_sample_of_draws_trains_like_the_same_trainer_without_vpipe(tmp_path: Path):
    from fuzz.run import run_fuzz
    from support.processes import warm_starter

    records = run_fuzz(SAMPLE, work=tmp_path, starter=warm_starter(), draw_timeout=300)
    assert [r["seed"] for r in records] == SAMPLE
    bad = [r for r in records if r["outcome"] not in ("identical", "close", "refused")]
    assert not bad, "\n".join(
        f"{r['outcome']} {r['signature']}\n  {r['describe']}\n  first differing step "
        f"{r.get('first_diff_step')}, "
        f"state {r.get('first_state_keys') or r.get('differing')}\n  {(r.get('error') or '')[-600:]}\n"
        f"  reproduce: python tests/fuzz/run.py --only {r['seed']}" for r in bad)
    assert sum(r["moves"] for r in records) >= len(SAMPLE)  # blocks did move
