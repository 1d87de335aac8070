"""Fitting a budget under a multi-stage schedule: a rank's stages run together in the rank's own order."""

from __future__ import annotations

from collections import Counter

import pytest

from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.fit import pipeline_fit, rank_action_order
from vpipe_lab.runtime.models import build_model

MODEL = {"blocks": 4, "d_model": 32, "n_heads": 2, "seq_len": 16, "micro_batches": 4, "micro_batch_size": 4,
         "dropout": 0.0}


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "loopedbfs", "interleavedzb", "zbv", "dualpipev"])
def test_a_rank_runs_each_forward_and_backward_of_its_stages_once_per_step(schedule):
    cfg = RunConfig(schedule=schedule, stages=2, **MODEL)
    for rank in range(2):
        order = rank_action_order(cfg, rank, steps=2)
        stages = cfg.rank_stages(rank)
        assert order[0] == ("F", stages[0], 0)  # a rank starts with its first stage's first forward
        assert [a for a in order if a[0] == "O"] == [("O", -1, 3), ("O", -1, 7)]
        work = Counter((kind, v, mb) for kind, v, mb in order if kind != "O")
        assert work == Counter({(kind, v, mb): 1 for kind in "FB" for v in stages for mb in range(8)})
        for v in stages:  # no micro-batch's backward before its forward
            seen = [(kind, mb) for kind, s, mb in order if s == v]
            assert all(seen.index(("F", mb)) < seen.index(("B", mb)) for mb in range(8))


def test_a_ranks_budget_is_shared_by_its_stages():
    cfg = RunConfig(schedule="zbv", stages=2, partition=[2, 1, 1, 2], **MODEL)
    kept = pipeline_fit(cfg, 1 << 62, managed=False)
    # per rank: stages 0+3, 1+2
    assert [(s.stage, s.policies) for s in kept.stages] == [(0, "DD/DD"), (1, "D/D")]
    assert kept.fits and all(s.peak_saved_bytes > 0 and s.working_bytes == 0 for s in kept.stages)
    model = build_model(cfg.model_spec())
    weights = [sum(p.numel() * p.element_size() for p in model[lid].parameters()) for lid in range(6)]
    # weights, gradients and Adam's two moments of the layers of both stages: 0, 1, 4, 5 on rank 0
    assert [s.fixed_bytes for s in kept.stages] == [4 * sum(weights[i] for i in (0, 1, 4, 5)),
                                                    4 * sum(weights[i] for i in (2, 3))]
    rank = kept.stages[0]
    budget = rank.fixed_bytes + 4 * rank.peak_saved_bytes // 5
    managed = pipeline_fit(cfg, budget, managed=True)  # each stage gets half the room for activations
    assert managed.fits and managed.stages[0].policies == "DR/DD", managed.to_dict()
    assert managed.stages[0].peak_saved_bytes < rank.peak_saved_bytes
    tiny = pipeline_fit(cfg, 2 * rank.fixed_bytes // 3, managed=True)
    assert not tiny.fits
    assert any(s.error == f"rank {s.stage}: its stages' fixed bytes {s.fixed_bytes} exceed the "
                          f"budget {s.budget_bytes}"
               for s in tiny.stages)
