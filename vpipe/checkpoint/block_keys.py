"""State-dict keys that follow the block: local block indices to global layer ids and back.

A trainer whose stage numbers its blocks locally (an ``nn.Sequential`` slice, a Hugging Face
``ModuleList`` of this stage's blocks) has the same keys on every stage: ``0.up.weight`` is a
different block on each. A distributed checkpoint (``torch.distributed.checkpoint``) keys
tensors by name across all ranks, so those keys collide, and after vpipe moves blocks a
local index names yet another block. Renaming the block index to its global layer id before
saving, and back after loading, gives every block one name wherever it runs; the tutorial's
and torchtitan's ``ModuleDict`` already keys blocks by global id and needs none of this.

``layer_ids[i]`` is the global id of the stage's ``i``-th block: ``vp.layer_ids`` with vpipe
attached, ``range(first, first + count)`` for a trainer's own split. Keys are model keys
(``[container.]i.rest``) or the optimizer's flattened keys (``state.<model key>.<name>`` and
``param_groups.<model key>.<name>``, what ``get_state_dict(...,
options=StateDictOptions(flatten_optimizer_state_dict=True))`` returns, as torchtitan
saves); other keys pass unchanged. Torch-free: only the keys change.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["global_block_keys", "local_block_keys"]

V = TypeVar("V")


def global_block_keys(state_dict: Mapping[str, V], layer_ids: Sequence[int],
                      container: str = "") -> dict[str, V]:
    """``state_dict`` with each block's local index replaced by its global layer id (before a DCP save)."""
    ids = _ids(layer_ids)

    def rename(index: int, key: str) -> int:
        if index >= len(ids):
            raise ValueError(f"global_block_keys: key {key!r} names local block {index}, but the stage has "
                             f"{len(ids)} block(s) (layer_ids {list(ids)})")
        return ids[index]

    return _renamed(state_dict, container, rename)


def local_block_keys(state_dict: Mapping[str, V], layer_ids: Sequence[int],
                     container: str = "") -> dict[str, V]:
    """``state_dict`` with global layer ids replaced by this stage's local indices (after a DCP load)."""
    ids = _ids(layer_ids)
    position = {lid: i for i, lid in enumerate(ids)}

    def rename(layer_id: int, key: str) -> int:
        if layer_id not in position:
            raise ValueError(f"local_block_keys: key {key!r} names layer {layer_id}, "
                             f"which is not one of this stage's layer_ids {list(ids)}")
        return position[layer_id]

    return _renamed(state_dict, container, rename)


def _ids(layer_ids: Sequence[int]) -> list[int]:
    ids = list(layer_ids)
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"layer_ids must be distinct non-negative integers, got {ids!r}")
    return ids


def _renamed(state_dict: Mapping[str, V], container: str, rename: Any) -> dict[str, V]:
    prefix = re.escape(f"{container}.") if container else ""
    pattern = re.compile(rf"^((?:state\.|param_groups\.)?{prefix})(\d+)(\..+)$")
    out: dict[str, V] = {}
    for key, value in state_dict.items():
        match = pattern.match(key)
        new = key if match is None else f"{match[1]}{rename(int(match[2]), key)}{match[3]}"
        if new in out:
            raise ValueError(f"two keys become {new!r}")
        out[new] = value
    return out
