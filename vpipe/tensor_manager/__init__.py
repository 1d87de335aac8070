"""The tensor manager: keep (D), swap (S) or recompute (R) each layer's saved activations.

``TensorManager`` is the per-stage facade; ``install_on_stage`` attaches one to a
``torch.distributed.pipelining`` stage. See ``manager.py`` for the parts it wires (one job
per module) and ``interception.py`` for how it hooks in.
"""

from vpipe.plan import Policy
from vpipe.tensor_manager.budget import MemoryBudgetError
from vpipe.tensor_manager.layers import is_routed_forward
from vpipe.tensor_manager.manager import DEFAULT_MIN_SWAP_BYTES, LayerBusyError, TensorManager
from vpipe.tensor_manager.pipelining import StageHandle, install_on_stage
from vpipe.tensor_manager.pool import HostPoolFullError
from vpipe.tensor_manager.stats import LayerStats, TensorManagerStats

__all__ = [
    "TensorManager",
    "Policy",
    "install_on_stage",
    "StageHandle",
    "MemoryBudgetError",
    "HostPoolFullError",
    "LayerBusyError",
    "LayerStats",
    "TensorManagerStats",
    "DEFAULT_MIN_SWAP_BYTES",
    "is_routed_forward",
]
