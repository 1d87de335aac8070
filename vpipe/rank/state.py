"""vpipe's part of a checkpoint: plan epoch, step, placement, policies, next layer id (plain JSON values).

The model's and the optimizer's tensors are the trainer's (or :mod:`vpipe.checkpoint`'s);
what vpipe adds is what a resumed run needs to continue where this one stops: the epoch
(so older plans stay stale), the step counter (forced moves name absolute steps), each
layer's policy, and the next layer id (ids are never reused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vpipe.checkpoint import VERSION, check_vpipe_state
from vpipe.log import decision
from vpipe.plan import Plan, Policy
from vpipe.rank.parts import RankParts
from vpipe.rank.steps import StepDriver

__all__ = ["vpipe_state", "restore_vpipe_state"]


def vpipe_state(parts: RankParts, iteration: int) -> dict[str, Any]:
    """Policies are this rank's own layers' (what its tensor managers run now) over the plan in force's;
    :func:`vpipe.checkpoint.save_checkpoint` merges the ranks'."""
    lm, owner = parts.layer_manager, parts.plan_in_force
    policies = {lid: p.value for lid, p in owner.plan.policies.items()}
    for manager in parts.tensor_managers.values():
        policies.update({lid: p.value for lid, p in manager.policies().items()})
    return {"version": VERSION, "epoch": owner.epoch, "iteration": iteration,
            "stages": [list(s) for s in owner.placement],
            "policies": {str(lid): p for lid, p in sorted(policies.items()) if lid in owner.order},
            "next_layer_id": max(lm.next_layer_id, max(owner.order) + 1)}


def restore_vpipe_state(state: Mapping[str, Any], parts: RankParts, *, driver: StepDriver, hand_written: bool,
                        who: int) -> None:
    """Continue from a checkpoint's vpipe state (every rank calls it with the same state, before a step).

    The layers must already be where this run placed them (the same layer set; the
    placement may differ, e.g. on another number of stages). The checkpoint's plan is
    committed as the plan in force: its epoch, and its policies for this rank's layers.
    """
    state = check_vpipe_state(dict(state))
    lm, owner = parts.layer_manager, parts.plan_in_force
    saved = sorted(lid for s in state["stages"] for lid in s)
    if saved != sorted(owner.order):
        raise ValueError(f"the checkpoint's layers {saved[:8]} are not this pipeline's layers "
                         f"{sorted(owner.order)[:8]}")
    policies = {int(k): Policy.parse(v) for k, v in state["policies"].items()}
    lm.next_layer_id = max(lm.next_layer_id, state["next_layer_id"])
    driver.iteration = state["iteration"]
    owner.commit(Plan(epoch=state["epoch"], stages=owner.placement, policies=policies), "restored")
    if hand_written:  # the open step gets the restored number
        parts.session.abort_step()
        driver.begin()
    epoch = owner.epoch
    decision("resumed", f"stage {who} resumes at step {driver.iteration}, plan epoch {epoch}",
             stage=who, step=driver.iteration, epoch=epoch, layers=lm.layer_ids, saved_stages=state["stages"],
             stages=[list(s) for s in owner.placement])
