"""Which optimizer param group a moving parameter joins on the stage it lands on.

Stages need not list their param groups alike: a Hugging Face-style trainer gives the
first stage ``[embeddings, decay, no_decay]`` and the last ``[decay, no_decay, head]``.
Matching groups by index would put a moved block's decayed weights into ``no_decay`` (or
into ``head``, with another learning rate) and silently change what the model learns. So a
parameter travels with its group's *settings* (every key but ``params``, the trainer's
``name`` included) and joins the receiving optimizer's group with the same settings (every
key both groups have is equal) of an optimizer of the same class (Muon's group and AdamW's may
agree on every key they share); where no group there has them, the move is refused, naming
the difference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["group_settings", "matching_group", "GroupMismatch", "OPTIMIZER_CLASS"]

# the settings' key naming the class of the optimizer that holds the group
OPTIMIZER_CLASS = "optimizer_class"

_PLAIN = (bool, int, float, str, type(None))


class GroupMismatch(ValueError):
    """No param group on the receiving stage has the settings of the one a moving parameter left."""


def _setting(value: Any) -> Any:
    """A group setting as a plain, comparable value that msgpack
    carries (tuples as lists, tensors as values)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [_setting(v) for v in value]
    if isinstance(value, torch.Tensor):  # a tensor learning rate (capturable / fused optimizers)
        return {"tensor": value.detach().cpu().tolist(), "dtype": str(value.dtype)}
    return {"object": type(value).__qualname__}  # compared by type only: the trainer's own object


def group_settings(group: Mapping[str, Any], kind: str | None = None) -> dict[str, Any]:
    """Everything a param group says about how its parameters train: every key but ``params``, and the
    class of the optimizer holding it (``kind``) where known."""
    settings = {str(k): _setting(v) for k, v in sorted(group.items(), key=lambda kv: str(kv[0]))
                if k != "params"}
    if kind is not None:
        settings[OPTIMIZER_CLASS] = kind
    return settings


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b if isinstance(a, (bool, int, float)) else a == b


def _differences(want: Mapping[str, Any], have: Mapping[str, Any]) -> list[str]:
    """The settings both groups have and differ in (a key one side lacks, such as the ``initial_lr`` an LR
    scheduler adds, says nothing about how the other side trains)."""
    keys = sorted(set(want) & set(have))
    return [f"{k} {have[k]!r} (not {want[k]!r})" for k in keys if not _same(want[k], have[k])]


def _label(settings: Mapping[str, Any]) -> str:
    name = settings.get("name")
    return f" {name!r}" if name is not None else ""


def matching_group(settings: Mapping[str, Any], groups: Sequence[Mapping[str, Any]], *, preferred: int | None,
                   what: str, kinds: Sequence[str] | None = None) -> int:
    """The index in ``groups`` of the group whose settings equal ``settings`` (``preferred``, the index the
    parameter had, when several do); ``kinds`` are the classes of the optimizers holding ``groups``.
    ``GroupMismatch`` names the closest group and how it differs."""
    have = [group_settings(group, kinds[i] if kinds is not None else None) for i, group in enumerate(groups)]
    diffs = [_differences(settings, h) for h in have]
    candidates = [i for i, d in enumerate(diffs) if not d]
    if candidates:
        return preferred if preferred in candidates else candidates[0]
    where = f"{what} trains in param group {preferred}{_label(settings)} on its stage"
    if not groups:
        raise GroupMismatch(f"{where}; the optimizer here has no param groups")
    closest = min(range(len(groups)), key=lambda i: (len(diffs[i]), i != preferred))
    raise GroupMismatch(f"{where}; no param group here has its settings (the closest, group {closest}"
                        f"{_label(have[closest])}, has {'; '.join(diffs[closest][:3])}): give every "
                        "stage's optimizer groups with the same settings, named alike where they are named")
