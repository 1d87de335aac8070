"""What every rank must agree on before acting, through the run's rendezvous store.

Attach is collective: every stage publishes how its block container is keyed and the ranks
derive the same global layer ids from all of them; a layer edit is published by every rank
and checked to be the same edit; plans are scheduled by stage 0 for a step every rank reads.
All of it lives under a namespace of its own per attach (``vpipe/attach-N/``), so an attach
after a detach never reads the previous one's keys, and detach deletes this rank's keys.
A pipeline that is one dimension of a mesh gets a namespace of its own inside it
(``vpipe/attach-N/pipeline-R/``, R the world rank of its stage 0; ranks count in its own
group), and :attr:`StoreAgreement.job` is the attach's namespace that every replica shares.

A rank that never makes the same call (an attach or an edit on some ranks only) ends the
wait after ``timeout_s`` (at most the process group's timeout, the trainer's) with an error
naming the missing stages, instead of a hang.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from vpipe.compat.torch_distributed import default_store, group_timeout_s
from vpipe.compat.torch_internals import child_modules
from vpipe.control.curve import RunKeys
from vpipe.control.run_key import agree_run_key
from vpipe.stage.blocks import (
    BlockContainerError,
    ContainerLayout,
    StageBlocks,
    agree_key_style,
    block_containers,
    common_container,
    container_kind,
    find_block_container,
    global_ids,
    layout_of,
)
from vpipe.stage.pipeline import LocalStage

log = logging.getLogger("vpipe.attach")

__all__ = ["StoreAgreement", "agree_on_blocks"]

# every attach gets keys of its own: attach is collective, so every rank counts its attaches alike, and an
# attach after a detach never reads the previous one's keys (plan epochs start again at 0)
_ATTACHES = itertools.count()


class StoreAgreement:
    """This rank's view of the attach's namespace in the store: what it wrote, what all wrote."""

    def __init__(self, store: Any, *, rank: int, world_size: int, timeout_s: float,
                 pipeline: str = "") -> None:
        job = f"vpipe/attach-{next(_ATTACHES)}/"
        base = store if store is not None else _default_store()
        self.namespace = job + pipeline
        self.job = dist.PrefixStore(job + "job/", base)  # what every replica of the pipeline shares
        self.store = dist.PrefixStore(self.namespace, base)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = min(timeout_s, group_timeout_s())  # the trainer's bound on its own collectives
        self._written: list[str] = []
        self._edits = 0

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)
        self._written.append(key)

    def get(self, key: str) -> str | None:
        """The value of ``key`` if some rank wrote it, else None (never waits)."""
        return self.store.get(key).decode() if self.store.check([key]) else None

    def gather(self, key: str, indices: Sequence[int], call: str, who: str, store: Any = None) -> list[bytes]:
        """The values of ``key`` (a pattern with ``{}``) for every index, once all are written (in ``store``,
        default this pipeline's namespace)."""
        store = self.store if store is None else store
        keys = [key.format(i) for i in indices]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [i for i, k in zip(indices, keys) if not store.check([k])]
                raise RuntimeError(f"{call} on {who}: stage(s) {missing} did not make the same call within "
                                   f"{self.timeout_s:.0f} s; every rank must call it, at the same step")
            time.sleep(0.01)
        return store.multi_get(keys)

    def agree_edit(self, edit: dict[str, Any], who: str) -> None:
        """Every rank makes the same layer edit, or every rank
        learns which did not (before anything changes)."""
        self._edits += 1
        key = f"edit/{self._edits}/{{}}"
        self.set(key.format(self.rank), json.dumps(edit, sort_keys=True))
        seen = [json.loads(raw) for raw in self.gather(key, range(self.world_size), edit["call"], who)]
        differ = [r for r, other in enumerate(seen) if other != edit]
        if differ:
            raise RuntimeError(f"{edit['call']} on {who}: stage(s) {differ} made another layer edit at this "
                               f"point ({seen[differ[0]]} vs {edit}); every rank must make the same one")

    def agree_refusal(self, refusal: str | None, *, world_rank: int, world_size: int, who: str) -> str | None:
        """Why layers cannot move anywhere in the job: the first refusal of any rank of any replica, or None.

        Moves are collective (a round ends in a vote of every rank), so either every rank
        moves layers or none does, whichever of its stages can."""
        key = "refusal/{}"
        self.job.set(key.format(world_rank), json.dumps(refusal))
        seen = [json.loads(raw) for raw in self.gather(key, range(world_size), "vpipe.attach", who,
                                                       store=self.job)]
        return next((r for r in seen if r is not None), None)

    def agree_run_secret(self, who: str, keys: RunKeys) -> str:
        """This run's control-plane key when the launcher made none (torchrun), never
        through the store (see ``vpipe.control.run_key``). ``keys``, the attach's,
        hold it: its sockets and its planner daemon get it."""
        return agree_run_key(self.store, rank=self.rank, world_size=self.world_size,
                             timeout_s=self.timeout_s, who=who, keys=keys)

    def clear(self, wait_s: float = 2.0) -> None:
        """Delete every key this rank wrote (detach), waiting at most ``wait_s`` for the store: one whose host
        stopped (a rank hosting it that hangs) never answers, and the process must still be able to end."""
        written, self._written = self._written, []
        deleting = threading.Thread(target=self._delete, args=(written,), daemon=True,
                                    name="vpipe-store-clear")
        deleting.start()
        deleting.join(wait_s)

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.store.delete_key(key)
            except Exception as e:  # noqa: BLE001 - a store already gone (the run is ending) holds nothing
                log.debug("rank %d: could not delete store key %s: %s", self.rank, key, e)


def agree_on_blocks(agreement: StoreAgreement, stages: Sequence[LocalStage], num_stages: int,
                    layers_path: str | None) -> tuple[tuple[int, ...], ...]:
    """Find every local stage's blocks, agree with the other ranks on one container path and how it is keyed,
    agree on global ids.

    Sets each local stage's ``blocks`` and returns the placement of every stage.
    """
    found_here: dict[int, tuple[str, Any]] = {}
    for stage in stages:
        if stage.container is not None:  # the adapter found them (a DeepSpeed stage): nothing to choose
            found_here[stage.index] = ("", stage.container)
            agreement.set(f"layers/{stage.index}", json.dumps({"path": "", "containers": []}))
            continue
        try:
            path, container = find_block_container(stage.module, layers_path)
            found_here[stage.index] = (path, container)
            mine: dict[str, Any] = {"path": path}
        except BlockContainerError as e:
            mine = {"error": str(e)}
        mine["containers"] = [] if layers_path is not None else block_containers(stage.module)
        agreement.set(f"layers/{stage.index}", json.dumps(mine))
    found = [json.loads(raw) for raw in
             agreement.gather("layers/{}", range(num_stages), "vpipe.attach", f"stage {stages[0].index}")]
    path = _one_path(found, stages, layers_path)
    for stage in stages:
        if found_here.get(stage.index, (None,))[0] != path and stage.container is None:
            found_here[stage.index] = find_block_container(stage.module, path)
        container = found_here[stage.index][1]
        agreement.set(f"keys/{stage.index}", json.dumps({"kind": container_kind(container),
                                                          "keys": list(child_modules(container))}))
    layouts = [ContainerLayout(path, f["kind"], tuple(f["keys"])) for f in (
        json.loads(raw) for raw in agreement.gather("keys/{}", range(num_stages), "vpipe.attach",
                                                    f"stage {stages[0].index}"))]
    style = agree_key_style(layouts)
    placement = tuple(tuple(ids) for ids in global_ids(layouts, style))
    for stage in stages:
        path_here, container = found_here[stage.index]
        assert layout_of(path_here, container).keys == layouts[stage.index].keys
        stage.blocks = StageBlocks(container, placement[stage.index], style, path_here)
    return placement


def _one_path(found: Sequence[dict[str, Any]], stages: Sequence[LocalStage], layers_path: str | None) -> str:
    """The container path every stage uses (the same answer on every rank: all read the same records)."""
    if layers_path is not None or all("error" in f for f in found):
        for stage in stages:  # this stage's own error first, then the others'
            if "error" in found[stage.index]:
                raise BlockContainerError(f"stage {stage.index}: {found[stage.index]['error']}")
        failed = [s for s, f in enumerate(found) if "error" in f]
        if failed:
            raise BlockContainerError(f"stage(s) {failed} could not find their blocks (their error says why)")
        return layers_path if layers_path is not None else found[0]["path"]
    try:
        return common_container([(f.get("path"), f["containers"]) for f in found])
    except BlockContainerError:
        for stage in stages:
            if "error" in found[stage.index]:
                raise BlockContainerError(f"stage {stage.index}: {found[stage.index]['error']}") from None
        raise


def _default_store() -> Any:
    store = default_store()
    if store is None:
        raise RuntimeError("cannot find torch.distributed's store; pass store= to vpipe.attach")
    return store
