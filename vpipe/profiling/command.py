"""What ``vpipe plan --model`` measures: the device, the factory's model, its layer graph.

The command itself (:mod:`vpipe.planner.cli`) stays free of torch so that ``vpipe plan
GRAPH.json`` starts fast; it calls :func:`measure_model` only when ``--model`` is given.
"""

from __future__ import annotations

import torch

from vpipe.graph import ModelGraph
from vpipe.output_paths import check_output_file
from vpipe.profiling.factory import load_model
from vpipe.profiling.model import profile_model

__all__ = ["resolve_device", "measure_model"]


def resolve_device(text: str) -> str:
    """``--device``: cpu, cuda, cuda:N, or auto (cuda if torch sees one)."""
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto; got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto; got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text}: this machine has no CUDA device torch can use "
                             f"(torch {torch.__version__})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {text}: there are {torch.cuda.device_count()} CUDA device(s)")
    return str(device)


def measure_model(spec: str, *, shape: str | None, dtype: str | None, device: str, repeats: int,
                  layers: str | None, save_graph: str | None) -> ModelGraph:
    """Load the factory ``spec``'s model, measure it on ``device`` (``--device``) with the block
    containers ``layers`` (``--layers``, found when None), and write the graph to ``save_graph`` if given."""
    device = resolve_device(device)
    containers = [p.strip() for p in layers.split(",")] if layers is not None else None
    if containers is not None and not all(containers):
        raise ValueError(f"--layers must be dotted module paths separated by commas, got {layers!r}")
    if save_graph is not None:  # before measuring: a planted link or a directory there is said at once
        check_output_file(save_graph, "--save-graph")
    loaded = load_model(spec, shape, dtype)
    model_graph = profile_model(loaded.model, loaded.args, loaded.kwargs, device=device, repeats=repeats,
                                containers=containers, source=spec)
    if save_graph is not None:
        model_graph.save(save_graph, "--save-graph")
    return model_graph
