"""Blocks that never move: those with hooks of the user's, and those that share a module or parameter.

A move rebuilds a block on another process from the receiving stage's own block of the
same kind and loads the moved tensors into it. Two things cannot be carried that way:

- **hooks** the user (or a torch utility such as ``weight_norm``) registered on the block or
  its submodules: forward, pre-forward, backward and (non-torch) state-dict hooks are Python
  callables, often holding state, that cannot cross processes. vpipe's own hooks are
  re-installed by vpipe on the block that arrives; hooks defined by torch's own modules
  for their state dicts (``checkpoint_wrapper``'s) are part of the module and are cloned, and
  FSDP2's come back when the arriving block is sharded like the stage's own, and the tensor
  parallel styles' are kept by the clone (:mod:`vpipe.stage.tensor_parallel`).
- **shared modules or parameters**: blocks that share one (a shared MLP, weight sharing
  across layers), or a block that shares one with the stage module outside the blocks.
  Packing such a block alone would make a second copy of the shared tensors on the
  receiving stage, or strip them from the sender's optimizer while another block still
  trains them.

Such a block is *pinned*: its kind, as the planner sees it, ends with
:data:`vpipe.plan.PINNED_KIND`, and the planner never proposes a partition that moves it
(a contiguous partition still moves the blocks around it). A move asked for anyway (a
forced plan, hooks added after attach) is refused before it commits, with one line
naming the block and why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn

from vpipe.compat.torch_distributed import is_parallel_style_hook
from vpipe.compat.torch_internals import hooks_of
from vpipe.plan import PINNED_KIND
from vpipe.stage.kinds import block_kind

__all__ = ["MOVING_HOOKS", "user_hooks", "users_hook", "outside_tensors", "shared_pins", "untrained_pins",
           "pin_reason", "planner_kind"]

MOVING_HOOKS = ("forward pre", "forward", "backward pre", "backward")
_STATE_HOOKS = ("state dict", "state dict pre", "load state dict pre", "load state dict post")


def _origin(fn: Any) -> tuple[str, str]:
    """(module, name) of a hook's code: through partials, bound methods, wrappers and callable objects."""
    for _ in range(8):
        inner = getattr(fn, "func", None) or getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return str(module), str(name)


def _vpipe(module: str) -> bool:
    return module == "vpipe" or module.startswith("vpipe.")


def _torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def _fsdp(module: str) -> bool:
    """FSDP2's forward hooks: a block that arrives is sharded like its donor, which installs its own."""
    return module.startswith("torch.distributed.fsdp.")


def users_hook(fn: Callable[..., Any], kind: str) -> bool:
    """Whether a hook of ``kind`` is the user's: not vpipe's, FSDP2's or a tensor-parallel style's, nor a
    state-dict hook torch's own modules define."""
    origin, _ = _origin(fn)
    return not (_vpipe(origin) or _fsdp(origin) or is_parallel_style_hook(fn)
                or (kind in _STATE_HOOKS and _torch(origin)))


def user_hooks(block: nn.Module) -> list[str]:
    """The hooks on ``block`` and its submodules that a move could not carry, described for a log line."""
    found = []
    for sub_name, module in block.named_modules():
        where = f" on {sub_name}" if sub_name else ""
        for kind in MOVING_HOOKS + _STATE_HOOKS:
            found += [f"{kind} hook {_origin(fn)[1]}{where}" for fn in hooks_of(module, kind).values()
                      if users_hook(fn, kind)]
    return found


def outside_tensors(stage_module: nn.Module, block_names: Iterable[str]) -> set[int]:
    """Ids of the parameters and buffers the stage module reaches other than through its blocks
    (``block_names``: each block's name in the stage module, ``layers.4``)."""
    prefixes = tuple(f"{name}." for name in block_names)
    return {id(t) for name, t in [*stage_module.named_parameters(remove_duplicate=False),
                                  *stage_module.named_buffers(remove_duplicate=False)]
            if not name.startswith(prefixes)}


def shared_pins(blocks: Mapping[int, nn.Module], outside: Iterable[int] = ()) -> dict[int, str]:
    """Blocks that share a parameter or buffer (or a module holding them) with another block, or with the
    stage module outside the blocks (``outside``: ids from :func:`outside_tensors`): layer id -> why."""
    owners: dict[int, list[int]] = {}  # id of a parameter or buffer -> the blocks holding it
    names: dict[tuple[int, int], str] = {}  # (tensor id, layer id) -> its name in that block
    for lid, block in blocks.items():
        # a shared module with tensors shares its tensors; one without (an activation) is harmless to copy
        for name, thing in [*block.named_parameters(remove_duplicate=False),
                            *block.named_buffers(remove_duplicate=False)]:
            holders = owners.setdefault(id(thing), [])
            if lid not in holders:
                holders.append(lid)
            names.setdefault((id(thing), lid), name)
    outer = set(outside)
    pins: dict[int, str] = {}
    for key, holders in owners.items():
        if len(holders) > 1:
            for lid in holders:
                pins.setdefault(lid, f"shares {names[key, lid]} with layers "
                                     f"{[h for h in holders if h != lid]}")
        elif key in outer:
            pins.setdefault(holders[0],
                            f"shares {names[key, holders[0]]} with the stage module outside its blocks")
    return pins


def untrained_pins(blocks: Mapping[int, nn.Module], optimizer: Any) -> dict[int, str]:
    """Blocks with a parameter that trains (``requires_grad``) in none of the optimizers given to attach:
    layer id -> why. On another stage it would join an optimizer and train, or be dropped from one it was
    never in, so such a block stays where it is."""
    if optimizer is None:
        return {}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    pins = {}
    for lid, block in blocks.items():
        loose = [name for name, p in block.named_parameters() if p.requires_grad and id(p) not in held]
        if loose:
            more = f" and {len(loose) - 1} more" if len(loose) > 1 else ""
            pins[lid] = f"has {loose[0]}{more} training in none of the optimizers given to vpipe.attach"
    return pins


def pin_reason(layer_id: int, block: nn.Module, shared: Mapping[int, str]) -> str | None:
    """Why ``block`` cannot move now (shared at attach, or hooks it carries now), or None."""
    if layer_id in shared:
        return shared[layer_id]
    hooks = user_hooks(block)
    if hooks:
        return f"carries {', '.join(hooks[:3])} (hooks cannot be carried to another process)"
    return None


def planner_kind(shared: Mapping[int, str],
                 ids: Callable[[], Mapping[int, nn.Module]]) -> Callable[[nn.Module], str]:
    """The block kind the monitors report: :func:`block_kind`,
    marked pinned for a block that must not move."""

    def kind(block: nn.Module) -> str:
        layer = next((lid for lid, b in ids().items() if b is block), None)
        pinned = (layer is not None and layer in shared) or bool(user_hooks(block))
        return block_kind(block) + PINNED_KIND if pinned else block_kind(block)

    return kind
