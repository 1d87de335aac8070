"""The engines vpipe runs under, one adapter each (:mod:`vpipe.engines.base` says what an adapter answers).

Adding an engine is one adapter module and one :func:`register_engine` line (below, or in
the trainer's code before ``attach``).
"""

from vpipe.engines.base import Capabilities, Engine, EngineKind
from vpipe.engines.deepspeed import DeepSpeedEngine
from vpipe.engines.module import ModuleEngine
from vpipe.engines.pipedream import PipeDreamEngine
from vpipe.engines.pipedream_2bw import PipeDream2BWEngine
from vpipe.engines.registry import engine_for, register_engine, registered_engines, unregister_engine
from vpipe.engines.torch_multi import TorchMultiEngine
from vpipe.engines.torch_single import TorchSingleEngine
from vpipe.engines.wpipe import WPipeEngine

__all__ = ["Capabilities", "Engine", "EngineKind", "engine_for", "register_engine", "registered_engines",
           "unregister_engine"]

# asked latest first: the plain module last (it takes any nn.Module), PipeDream
# before torch's single-stage schedules, 2BW before PipeDream
register_engine(ModuleEngine)
register_engine(TorchSingleEngine)
register_engine(TorchMultiEngine)
register_engine(DeepSpeedEngine)
register_engine(PipeDreamEngine)
register_engine(PipeDream2BWEngine)  # after PipeDream's: a SchedulePipeDream2BW is a SchedulePipeDream
# after torch's multi-stage schedules': a ScheduleWPipe is a PipelineScheduleMulti
register_engine(WPipeEngine)
