"""The reference trainer's configuration, validated where it enters (CLI, JSON, tests)."""

from __future__ import annotations

import dataclasses
import math
import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:  # models imports torch: the CLI's light commands (logs, planner) must not pay for it
    from vpipe_lab.runtime.models import ModelSpec

from vpipe.output_paths import check_output_dir, check_output_file
from vpipe_lab.runtime.layout import MULTI_STAGE, SCHEDULES, STREAMS, V_SHAPED, rank_stages, stage_rank

MODELS = ("transformer", "cnn")
OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("constant", "warmup-cosine")


@dataclass
class RunConfig:
    """One training run of a reference model on a pipeline of ``stages`` ranks.

    Each rank runs ``n_local_stages`` stages (1 under GPipe, 1F1B and PipeDream; 2 by
    default under the multi-stage schedules, laid out as :mod:`vpipe_lab.runtime.layout` says),
    so ``partition`` and forced ``moves`` count layers per *virtual* stage, in model order.
    """

    model: str = "transformer"
    blocks: int = 8
    d_model: int = 64
    n_heads: int = 4
    seq_len: int = 64
    dropout: float = 0.1
    block_types: list[str] | None = None
    stages: int = 2  # ranks
    schedule: str = "gpipe"
    stages_per_rank: int | None = None  # virtual stages per rank; None: 1, or 2 under a multi-stage schedule
    micro_batches: int = 4
    micro_batch_size: int = 4
    steps: int = 20
    lr: float = 1e-3
    optimizer: str = "adam"
    weight_decay: float = 0.0
    # warmup-cosine: linear warm-up over warmup_steps, then cosine to 0 at steps
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    seed: int = 0
    partition: list[int] | None = None  # layers per (virtual) stage, in order
    moves: list[dict[str, Any]] | None = None  # forced repartitions: [{"step": s, "partition": [...]}, ...]
    # layer edits: [{"step": s, "add": {"position": p, "types": [...]}},
    nas: list[dict[str, Any]] | None = None
    #                                          {"step": s, "remove": [ids]}]; vpipe and flush schedules only
    vertical_sync: bool = False
    log_file: str | None = None
    out_dir: str | None = None
    progress: bool = True
    monitor_every: int = 0  # sample every k-th step with the monitor + control plane; 0 = off
    # daemon's planner; None = wait for `vpipe planner`
    planner: str | None = "vpipe.control.daemon:no_change"
    vpipe: bool = False  # attach vpipe (tensor manager, monitor, planner, layer manager) to every stage
    # vpipe: bytes per stage (parameters, gradients, optimizer state, activations)
    memory_budget: int | None = None
    policy: str = "D"  # vpipe: initial keep (D) / swap (S) / recompute (R) policy of every layer
    planning: bool = True  # vpipe: apply the planner's plans
    # write a checkpoint here every ``checkpoint_every`` steps and at the end
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only at the end (when checkpoint_dir is set)
    # continue from this checkpoint (a step-* directory, or the newest one under it)
    resume: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.model in MODELS, f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        need(self.schedule in SCHEDULES,
             f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        need(self.optimizer in OPTIMIZERS,
             f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        need(self.lr_schedule in LR_SCHEDULES,
             f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        need(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
             f"warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        need(self.weight_decay >= 0 and self.weight_decay == self.weight_decay,
             f"weight_decay must be >= 0, got {self.weight_decay!r}")
        for name in ("blocks", "d_model", "n_heads", "seq_len", "stages", "micro_batches",
                     "micro_batch_size"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                 f"{name} must be a positive integer, got {getattr(self, name)!r}")
        need(isinstance(self.steps, int) and self.steps >= 0, f"steps must be >= 0, got {self.steps!r}")
        need(isinstance(self.monitor_every, int) and self.monitor_every >= 0,
             f"monitor_every must be an integer >= 0, got {self.monitor_every!r}")
        need(self.planner is None or (isinstance(self.planner, str) and ":" in self.planner),
             f"planner must be an import path module:function, got {self.planner!r}")
        need(self.policy in ("D", "S", "R"), f"policy must be D, S or R, got {self.policy!r}")
        need(self.memory_budget is None or (isinstance(self.memory_budget, int) and self.memory_budget > 0),
             f"memory_budget must be a positive number of bytes, got {self.memory_budget!r}")
        need(self.vpipe or not self.moves, "forced moves need vpipe (the layer manager moves the layers)")
        need(self.vpipe or not self.nas, "adding and removing layers needs vpipe (the layer manager does it)")
        need(not (self.nas and self.moves), "combine either forced moves or layer edits in one run, not both")
        need(not (self.nas and self.schedule in STREAMS),
             f"layer edits need a flush schedule (any but {self.schedule})")
        need(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        need(isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0,
             f"lr must be a positive finite number, got {self.lr}")
        need(not self.vertical_sync or self.schedule == "pipedream",
             f"vertical_sync is a PipeDream option; {self.schedule} " + (
                 "runs every stage on one version already" if self.schedule in STREAMS
                                                                         else "keeps no weight versions"))
        need(self.d_model % self.n_heads == 0,
             f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        self._check_size()
        if self.block_types is not None:
            need(len(self.block_types) == self.blocks,
                 f"block_types has {len(self.block_types)} entries for {self.blocks} blocks")
            from vpipe_lab.runtime.models import BLOCK_TYPES

            bad = [t for t in self.block_types if t not in BLOCK_TYPES]
            need(not bad, f"unknown block types {bad}; known: {', '.join(BLOCK_TYPES)}")
        self._check_layout()
        n_layers = self.n_layers
        need(self.virtual_stages <= n_layers, f"{self._stages_text} but the model has only {n_layers} layers")
        if self.schedule in ("1f1b", *STREAMS):
            need(self.micro_batches >= self.stages,
                 f"{self.schedule} needs micro_batches >= stages ({self.micro_batches} < {self.stages})")
        if self.partition is not None:
            need(len(self.partition) == self.virtual_stages,
                 f"partition has {len(self.partition)} entries for {self._stages_text}")
            need(all(isinstance(c, int) and c >= 1 for c in self.partition),
                 f"every stage needs at least one layer, got partition {self.partition}")
            need(sum(self.partition) == n_layers,
                 f"partition {self.partition} covers {sum(self.partition)} layers, the model has {n_layers}")
        self._check_nas(n_layers)
        self._check_checkpoints()
        self._check_paths()
        last_step = 0
        for i, move in enumerate(self.moves or []):
            need(isinstance(move, dict) and set(move) == {"step", "partition"},
                 f"moves[{i}] must be {{'step': int, 'partition': [layers per stage]}}, got {move!r}")
            step, counts = move["step"], move["partition"]
            need(isinstance(step, int) and step > last_step,
                 f"moves[{i}]: steps must be increasing integers >= 1, got {step!r}")
            last_step = step
            need(isinstance(counts, list) and len(counts) == self.virtual_stages
                 and all(isinstance(c, int) and c >= 1 for c in counts) and sum(counts) == n_layers,
                 f"moves[{i}]: partition {counts!r} must give each of the {self._stages_text} >= 1 of the "
                 f"{n_layers} layers")
            g0 = sum(self.layer_counts()[:self.stages])  # WPipe's groups keep their layers (G0: the first W)
            need(self.schedule != "wpipe" or sum(counts[:self.stages]) == g0,
                 f"moves[{i}]: partition {counts!r} moves layers between wpipe's groups; its first "
                 f"{self.stages} stages (G0) keep {g0} layers")

    def _check_layout(self) -> None:
        """Virtual stages per rank as the schedule runs them, and
        the micro-batch counts torch's schedules accept."""
        per_rank, name, m = self.stages_per_rank, self.schedule, self.micro_batches
        if per_rank is not None and (not isinstance(per_rank, int) or isinstance(per_rank, bool)
                                     or per_rank < 1):
            raise ValueError(f"stages_per_rank must be a positive integer, got {per_rank!r}")
        if name not in MULTI_STAGE:
            if per_rank not in (None, 1):
                raise ValueError(f"{name} runs one stage per rank; {per_rank} stages per "
                                 f"rank need a multi-stage schedule ({', '.join(MULTI_STAGE)})")
            return
        if name in V_SHAPED and per_rank not in (None, 2):
            raise ValueError(f"{name} runs exactly 2 stages per rank (a V), got stages_per_rank {per_rank}")
        if name == "wpipe" and per_rank not in (None, 2):
            raise ValueError("wpipe runs exactly 2 stages per rank (G0's and G1's), got "
                             f"stages_per_rank {per_rank}")
        if per_rank == 1:
            raise ValueError(f"{name} runs several stages per rank: stages_per_rank must be >= 2, got 1 "
                             "(1f1b runs one stage per rank)")
        if self.vertical_sync:
            raise ValueError(f"vertical_sync is a PipeDream option; {name} keeps no weight versions")
        rounds = max(1, m // self.stages)
        if name in ("interleaved1f1b", "interleavedzb") and m % rounds:
            raise ValueError(f"{name} needs micro_batches to be a multiple of its rounds, "
                             "max(1, micro_batches // "
                             f"ranks) = {rounds}; got {m} micro-batches on {self.stages} ranks")
        if name == "dualpipev" and m < self.virtual_stages:
            raise ValueError(f"dualpipev needs micro_batches >= its {self.virtual_stages} stages, got {m}")

    def _check_checkpoints(self) -> None:
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be an integer >= 0, got {self.checkpoint_every!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every needs checkpoint_dir (where to write the checkpoints)")
        if (self.checkpoint_dir or self.resume) and self.schedule in STREAMS:
            raise ValueError(f"checkpoints need a flush schedule (any but {self.schedule}): a PipeDream "
                             "stream never has every micro-batch's weights at rest")
        if (self.checkpoint_dir or self.resume) and self.nas:
            raise ValueError("checkpoints cannot be combined with layer edits (--nas) yet")

    def _check_size(self) -> None:
        """A model or batch no machine of this size can hold is refused here, not by an
        allocation traceback on every rank: its weights with their gradients and Adam moments
        (about 12 d_model^2 per block, 16 bytes each), or one micro-batch's activations
        through every block (about 20 values per d_model each)."""
        memory = psutil.virtual_memory().total
        weights = self.blocks * 12 * self.d_model ** 2 * 16
        activations = self.micro_batch_size * self.seq_len * self.d_model * self.blocks * 20 * 4
        for what, need_bytes in (("the model's weights, gradients and optimizer state", weights),
                                 ("one micro-batch's activations", activations)):
            if need_bytes > memory:
                raise ValueError(f"{what} would take about {need_bytes / 2**30:,.0f} GiB "
                                 f"(blocks {self.blocks}, "
                                 f"d_model {self.d_model}, micro_batch_size {self.micro_batch_size}, seq_len "
                                 f"{self.seq_len}); this machine has {memory / 2**30:,.0f} GiB")

    def _check_paths(self) -> None:
        """Every path the run writes, checked before it starts (not
        after training, when results would be lost)."""
        if self.log_file is not None:
            check_output_file(self.log_file, "log file")
        # what the ranks write there (the last one nas.json), links planted there refused
        if self.out_dir is not None:
            check_output_dir(self.out_dir, "out_dir", [f"rank{r}.{kind}" for r in range(self.stages)
                                                       for kind in ("pt", "json")] + ["nas.json"])
        if self.checkpoint_dir is not None:
            check_output_dir(self.checkpoint_dir, "checkpoint_dir")
        if self.resume is not None:
            try:
                is_file = not stat.S_ISDIR(os.stat(self.resume).st_mode)
            except (FileNotFoundError, NotADirectoryError):
                is_file = False  # nothing there yet: the run starts from step 0
            except OSError as e:  # a name too long, a directory it cannot search
                raise ValueError(f"resume {self.resume}: {e.strerror or e}") from None
            if is_file:
                raise ValueError(f"resume {self.resume} is a file; give a checkpoint "
                                 f"directory (or the directory of checkpoints)")

    def _check_nas(self, n_layers: int) -> None:
        """Replay the layer edits on the layer ids, so a bad one fails before any rank starts."""
        from vpipe_lab.runtime.models import BLOCK_TYPES

        ids = list(range(n_layers))
        next_id, last_step = n_layers, 0
        for i, event in enumerate(self.nas or []):
            where = f"nas[{i}]"
            if not isinstance(event, dict) or "step" not in event or len(set(event) & {"add", "remove"}) != 1:
                raise ValueError(f"{where} must be {{'step': s, 'add': {{...}}}} or "
                                 f"{{'step': s, 'remove': [ids]}}")
            step = event["step"]
            if not isinstance(step, int) or step < last_step or step < 1:
                raise ValueError(f"{where}: steps must be non-decreasing integers >= 1, got {step!r}")
            last_step = step
            if "add" in event:
                add = event["add"]
                types = add.get("types") if isinstance(add, dict) else None
                position = add.get("position") if isinstance(add, dict) else None
                if not isinstance(types, list) or not types or any(t not in BLOCK_TYPES for t in types):
                    raise ValueError(f"{where}: 'types' must list block types from {', '.join(BLOCK_TYPES)}")
                if not isinstance(position, int) or not 1 <= position <= len(ids) - 1:
                    raise ValueError(f"{where}: position must be between 1 and {len(ids) - 1} (after the "
                                     f"embedding, before the head), got {position!r}")
                ids[position:position] = list(range(next_id, next_id + len(types)))
                next_id += len(types)
            else:
                doomed = event["remove"]
                if not isinstance(doomed, list) or not all(isinstance(d, int) for d in doomed):
                    raise ValueError(f"{where}: 'remove' must be a list of layer ids")
                unknown = sorted(set(doomed) - set(ids[1:-1]))
                if unknown:
                    raise ValueError(f"{where}: cannot remove {unknown}: not a block of the "
                                     f"model at step {step}")
                ids = [lid for lid in ids if lid not in doomed]

    @property
    def n_local_stages(self) -> int:
        """Virtual stages each rank runs."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule in MULTI_STAGE else 1

    @property
    def virtual_stages(self) -> int:
        """Stages of the pipeline (ranks x stages per rank): what ``partition`` and ``moves`` count."""
        return self.stages * self.n_local_stages

    @property
    def multi_stage(self) -> bool:
        return self.schedule in MULTI_STAGE

    @property
    def _stages_text(self) -> str:
        if not self.multi_stage:
            return f"{self.stages} stages"
        return f"{self.virtual_stages} stages ({self.stages} ranks x {self.n_local_stages})"

    def stage_rank(self, stage: int) -> int:
        """The rank that runs virtual stage ``stage``."""
        return stage_rank(self.schedule, stage, self.stages)

    def rank_stages(self, rank: int) -> list[int]:
        """The virtual stages ``rank`` runs, in model order."""
        return rank_stages(self.schedule, rank, self.stages, self.n_local_stages)

    @property
    def n_layers(self) -> int:
        return len(self.model_spec().layers)

    def model_spec(self) -> ModelSpec:
        from vpipe_lab.runtime.models import cnn, transformer_lm

        if self.model == "cnn":
            return cnn()
        return transformer_lm(
            n_blocks=self.blocks,
            d_model=self.d_model,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            dropout=self.dropout,
            block_types=self.block_types,
        )

    def layer_counts(self, step: int = 0) -> list[int]:
        """Layers per (virtual) stage at ``step``: the last forced move before it, else the initial partition
        (given, or as even as possible with the extra layers first)."""
        for move in reversed(self.moves or []):
            if move["step"] <= step:
                return list(move["partition"])
        if self.partition is not None:
            return list(self.partition)
        n, p = self.n_layers, self.virtual_stages
        return [n // p + (1 if s < n % p else 0) for s in range(p)]

    def stage_layer_ids(self, step: int = 0) -> list[list[int]]:
        ids, start = [], 0
        for count in self.layer_counts(step):
            ids.append(list(range(start, start + count)))
            start += count
        return ids

    @property
    def batch_size(self) -> int:
        return self.micro_batches * self.micro_batch_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        if not isinstance(data, dict):
            raise ValueError(f"a run config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown run config keys: {', '.join(unknown)}")
        return cls(**data)
