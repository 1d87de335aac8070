"""State dicts that say which blocks they hold, so one taken under
another placement is refused, not misloaded.

A trainer that keeps ``copy.deepcopy(stage_module.state_dict())`` (and its optimizer's) to
roll back after a loss spike loads it into a stage that may hold other blocks by then: torch
fails with its strict-load error when the block count changed, and, worse, a slice renumbered
``0..n-1`` of the same length loads another block's weights without a word. vpipe stamps the
stage module's and the optimizer's state dicts with the global ids of the blocks they hold
(in the state dict's own metadata, which ``copy.deepcopy`` keeps), and refuses to load one
whose blocks are not the stage's now, in one line that says which moved and what restores
state across moves instead (a DCP snapshot keyed by global block ids). A state dict without a
stamp (taken before attach) loads as torch decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["StaleStateError", "stamp_state_dicts"]

_KEY = "vpipe_blocks"  # in a module's state-dict metadata, and as a key of an optimizer's state dict
_ADVICE = ("snapshot with torch.distributed.checkpoint and vpipe.global_block_keys instead, "
           "which restores each block where it lives now (docs/reliability.md, 'Rolling back across moves')")


class StaleStateError(ValueError):
    """A state dict taken when the stage held other blocks."""


def _ids(ids: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, ids)) + "]"


def _check(what: str, stamped: Any, now: list[int]) -> None:
    if stamped is None or list(stamped) == now:
        return
    was = [int(i) for i in stamped]
    gone, came = sorted(set(was) - set(now)), sorted(set(now) - set(was))
    moved = "; ".join(part for part in (f"blocks {_ids(gone)} left" if gone else "",
                                        f"blocks {_ids(came)} arrived" if came else "")
                      if part) or "reordered"
    raise StaleStateError(f"vpipe: this {what} state dict holds blocks {_ids(was)}, the stage "
                          f"holds {_ids(now)} now ({moved} since it was taken); {_ADVICE}")


def stamp_state_dicts(modules: Sequence[tuple[nn.Module, Callable[[], list[int]]]],
                      optimizers: Sequence[torch.optim.Optimizer], blocks: Callable[[], list[int]]
                      ) -> Callable[[], None]:
    """Stamp and check the state dicts of this rank's stage modules (each with the
    global ids of the blocks it holds, in order) and of its ``optimizers`` (with
    ``blocks()``, those of all the rank's stages); returns the undo."""
    handles: list[Any] = []

    def on_module(held: Callable[[], list[int]]) -> tuple[Any, Any]:
        def stamp(module: nn.Module, state: Any, prefix: str, local: dict[str, Any]) -> None:
            local[_KEY] = held()

        def check(module: nn.Module, state: Any, prefix: str, local: dict[str, Any], *_: Any) -> None:
            _check("stage module", local.get(_KEY), held())

        return stamp, check

    def optimizer_stamp(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        state[_KEY] = blocks()
        return state

    def optimizer_check(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        _check("optimizer", state.get(_KEY), blocks())
        return {k: v for k, v in state.items() if k != _KEY}

    for module, held in modules:
        stamp, check = on_module(held)
        handles += [module.register_state_dict_post_hook(stamp),
                    module.register_load_state_dict_pre_hook(check)]
    for optimizer in optimizers:
        handles += [optimizer.register_state_dict_post_hook(optimizer_stamp),
                    optimizer.register_load_state_dict_pre_hook(optimizer_check)]

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo
