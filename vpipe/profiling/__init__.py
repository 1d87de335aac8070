"""Layer graphs measured from torch modules: the builders of :class:`vpipe.graph.LayerGraph`.

The graph itself is torch-free (the planner and ``vpipe plan GRAPH.json`` read it without
torch); measuring it needs the module, so the builders live here:

- :func:`from_layers`: a chain of layers, each timed forward and backward in turn;
- :func:`from_fx`: one node per operator of a ``torch.fx`` trace, measured or roofline-costed;
- :func:`profile_model`: one node per block and module of a whole model, measured by replaying
  the inputs the model's own forward gave each one (what ``vpipe plan --model`` runs);
- :func:`load_model`: the user's ``MODULE:FACTORY`` and its example input.
"""

from __future__ import annotations

from vpipe.profiling.factory import ModelInput, load_model
from vpipe.profiling.fx import from_fx
from vpipe.profiling.layers import LayerProfile, from_layers, param_bytes, profile_layers
from vpipe.profiling.model import profile_model
from vpipe.profiling.units import find_units

__all__ = ["from_layers", "from_fx", "profile_layers", "profile_model", "find_units", "load_model",
           "ModelInput",
           "LayerProfile", "param_bytes"]
