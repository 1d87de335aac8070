"""DeepSpeed's pipeline engine parts that vpipe reads or edits, each behind a named function.

vpipe never imports DeepSpeed: it recognises the engine and the layer specs by class and
module name, so attaching to a torch schedule costs nothing when DeepSpeed is installed and
nothing breaks when it is not. Checked: DeepSpeed 0.19.8 (the version the ``deepspeed``
extra installs and the suite runs).

What is read or written, beyond the engine's public methods (``train_batch``,
``save_checkpoint``, ``reset_activation_shape``, ``bfloat16_enabled``, ``fp16_enabled``,
``zero_optimization_stage``) and the pipeline module's public attributes (``forward_funcs``,
``fwd_map``, ``parts``, ``activation_checkpoint_interval``, ``set_checkpoint_interval``, and
``is_checkpointable_results_interval``, cleared so that ``set_checkpoint_interval`` regroups the layers) and
the engine's ``param_names`` (parameter -> name, kept current as blocks arrive and leave):
``PipelineModule._layer_specs`` (every stage's layer specs, in model order) and
``._local_start`` / ``._local_stop`` (this stage's layer range; its checkpoint files are named
by it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["is_pipeline_engine", "is_pipeline_module", "layer_specs", "spec_class", "is_tied_spec",
           "local_range",
           "set_local_range"]


def _named(obj: Any, name: str, module_prefix: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith(module_prefix) for c in type(obj).__mro__)


def is_pipeline_engine(obj: Any) -> bool:
    """Whether ``obj`` is DeepSpeed's ``PipelineEngine`` (what ``deepspeed.initialize`` returns for a
    ``PipelineModule``). Checked: 0.19.8."""
    return _named(obj, "PipelineEngine", "deepspeed.runtime.pipe")


def is_pipeline_module(obj: Any) -> bool:
    """Whether ``obj`` is DeepSpeed's ``PipelineModule`` (what a trainer passes to ``deepspeed.initialize``).
    Checked: 0.19.8."""
    return _named(obj, "PipelineModule", "deepspeed.runtime.pipe")


def layer_specs(module: Any) -> Sequence[Any]:
    """Every layer spec of the whole model (not only this stage's), in model order. Checked: 0.19.8."""
    return list(module._layer_specs)


def is_tied_spec(spec: Any) -> bool:
    """Whether ``spec`` is a ``TiedLayerSpec`` (one module, shared
    by the stages that use it). Checked: 0.19.8."""
    return _named(spec, "TiedLayerSpec", "deepspeed.runtime.pipe")


def spec_class(spec: Any) -> str | None:
    """The class a layer spec builds, by qualified name, for a layer DeepSpeed registers under its index
    (a ``LayerSpec`` or a module); None for a ``TiedLayerSpec`` (registered under ``tied_modules``, shared
    between stages) and for a plain function. Checked: 0.19.8."""
    if is_tied_spec(spec):
        return None
    if _named(spec, "LayerSpec", "deepspeed.runtime.pipe"):
        built = spec.typename
        return f"{built.__module__}.{built.__qualname__}"
    if isinstance(spec, nn.Module):
        return f"{type(spec).__module__}.{type(spec).__qualname__}"
    return None


def local_range(module: Any) -> tuple[int, int]:
    """This stage's layers, as ``[start, stop)`` global indices. Checked: 0.19.8."""
    start, stop = module._local_start, module._local_stop
    return int(start), int(stop)


def set_local_range(module: Any, start: int, stop: int) -> None:
    """Set this stage's layer range: its checkpoint files and layer seeds are numbered from ``start``.
    Checked: 0.19.8."""
    module._local_start, module._local_stop = start, stop
