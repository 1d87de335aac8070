"""A model plan in the formats other trainers read: torchtitan's config and Megatron's layout string.

**torchtitan** (the ``[parallelism]`` section of its job config) splits a model by
``module_fqns_per_model_part``: one list of module names per (virtual) stage. Its splitter
walks the model's top-level children: an ``nn.ModuleList`` / ``nn.ModuleDict`` child keeps
the entries named ``child.key``, any other child is kept whole when its name is listed
and dropped otherwise. So vpipe can write the split this way when every unit is a
top-level child or an entry of a top-level container. Without that list torchtitan splits
its own models (``tok_embeddings``, ``layers.N``, ``norm``, ``output``) itself: with ``S``
stages and ``N`` blocks it counts the embedding as ``first_stage_less_layers`` blocks and
norm + output as ``last_stage_less_layers`` blocks, gives each stage ``(N + first + last)
// S`` of those (one more to the first ``(N + first + last) % S`` stages) and takes the
embedding's and the head's share off the first and the last stage. vpipe prints the two
numbers when some pair gives exactly its blocks per stage (and the stage count is
torchtitan's default: one per rank, two under a multi-stage schedule).

**Megatron-LM** reads ``--pipeline-model-parallel-layout``: stages in model order separated
by ``|``, ``E`` the embedding, ``t`` a transformer (decoder) layer, ``L`` the loss (the final
norm and output layer with it), ``x*N`` a repeat, commas cosmetic; the first symbol must be
``E`` and the last ``L``, each once. Stage ``i`` runs on pipeline rank ``i % size`` (virtual
stages interleaved), so the string fits the single-stage and looped schedules, not the
V-shaped ones. vpipe writes it for a model with one container of blocks, with the modules
before the blocks on the first stage and those after them on the last.

Torch-free: it reads the plan's module names and which units are blocks.
"""

from __future__ import annotations

import json
from typing import Any

from vpipe.graph import Unit

__all__ = ["torchtitan_form", "megatron_form", "TORCHTITAN_SCHEDULES", "format_lines", "torchtitan_counts"]

# the cost model's schedule names -> torch's names, which torchtitan's pipeline_parallel_schedule takes
TORCHTITAN_SCHEDULES = {
    "gpipe": "GPipe", "1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B", "loopedbfs": "LoopedBFS",
    "interleavedzb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV",
}
_V_SHAPED = ("zbv", "dualpipev")
_MULTI = ("interleaved1f1b", "loopedbfs", "interleavedzb", "zbv", "dualpipev")


def _ends(stages: list[list[str]], units: list[Unit]) -> tuple[list[str], list[str], str | None]:
    """The units before the blocks, after them, and why the model is not one stack of blocks (or None)."""
    containers = {u.container for u in units if u.container is not None}
    if len(containers) != 1:
        return [], [], (f"the model has {len(containers)} block containers; these forms describe one stack "
                        "of blocks")
    kinds = "".join("t" if u.container is not None else "x" for u in units)
    first, last = kinds.index("t"), kinds.rindex("t")
    if "x" in kinds[first:last]:
        return [], [], "a module that is not a block runs between the blocks"
    before = [u.name for u in units[:first]]
    after = [u.name for u in units[last + 1:]]
    if not (before and after):
        return before, after, (f"the model has no module {'before' if not before else 'after'} its blocks to be the "
                               "embedding and the head")
    if before and not set(before) <= set(stages[0]):
        return before, after, f"the modules before the blocks ({', '.join(before)}) are not all on the first stage"
    if after and not set(after) <= set(stages[-1]):
        return before, after, f"the modules after the blocks ({', '.join(after)}) are not all on the last stage"
    return before, after, None


def torchtitan_counts(num_stages: int, num_layers: int, first_less: int, last_less: int) -> list[int] | None:
    """Blocks per stage that torchtitan's own split gives (None where it refuses the numbers)."""
    effective = num_layers + first_less + last_less
    if num_stages == 1:
        return [num_layers]
    if num_stages > effective:
        return None
    per, extra = divmod(effective, num_stages)
    if per == 0 or first_less > per or last_less > per:
        return None
    counts, placed = [], 0
    for k in range(num_stages):
        want = per + (1 if k < extra else 0)
        want -= first_less if k == 0 else last_less if k == num_stages - 1 else 0
        take = max(0, min(want, num_layers - placed))
        counts.append(take)
        placed += take
    return counts


def _less_layers(blocks: list[int], stages_per_rank: int, schedule: str) -> tuple[int, int] | None:
    default = 2 if schedule in _MULTI else 1
    if stages_per_rank != default:
        return None
    n, s = sum(blocks), len(blocks)
    # torchtitan needs first, last <= per stage <= (n + first + last) / s, so neither exceeds n / (s - 2)
    limit = n if s <= 2 else n // (s - 2) + 1
    for first in range(limit + 1):
        for last in range(limit + 1):
            if torchtitan_counts(len(blocks), n, first, last) == blocks:
                return first, last
    return None


def torchtitan_form(stages: list[list[str]], units: list[Unit], schedule: str, ranks: int,
                    stages_per_rank: int) -> dict[str, Any]:
    """torchtitan's ``[parallelism]`` fields for the plan; a field it cannot express is None, with a note why."""
    notes: list[str] = []
    deep = [u.name for u in units if "." in (u.name if u.container is None else u.container)]
    fqns = None if deep else [list(names) for names in stages]
    if deep:
        notes.append(f"module_fqns_per_model_part: torchtitan splits only top-level children and the entries of "
                     f"top-level ModuleList/ModuleDict containers; {deep[0]} is deeper")
    blocks = [sum(1 for name in names if name in {u.name for u in units if u.container is not None})
              for names in stages]
    _, _, why = _ends(stages, units)
    if deep and why is None:
        why = "torchtitan's own split is for models it can split by module names (see above)"
    less = None if why else _less_layers(blocks, stages_per_rank, schedule)
    if less is None:
        notes.append("first/last_stage_less_layers: " + (why or f"no pair gives blocks per stage "
                                                                f"{','.join(map(str, blocks))} with {stages_per_rank} "
                                                                f"stage(s) per rank"))
    if schedule not in TORCHTITAN_SCHEDULES:
        notes.append(f"pipeline_parallel_schedule: torchtitan has no {schedule} schedule")
    return {
        "pipeline_parallel_degree": ranks,
        "pipeline_parallel_schedule": TORCHTITAN_SCHEDULES.get(schedule),
        "module_fqns_per_model_part": fqns,
        "pipeline_parallel_first_stage_less_layers": None if less is None else less[0],
        "pipeline_parallel_last_stage_less_layers": None if less is None else less[1],
        "notes": notes,
    }


def megatron_form(stages: list[list[str]], units: list[Unit], schedule: str, ranks: int) -> dict[str, Any]:
    """Megatron's ``--pipeline-model-parallel-size`` and ``--pipeline-model-parallel-layout`` (None, with a note
    why, where the plan cannot be written as one)."""
    before, after, why = _ends(stages, units)
    if why is None and schedule in _V_SHAPED:
        why = f"Megatron places stage i on rank i % {ranks}; {schedule} places its stages in a V"
    layout = None
    if why is None:
        ends = set(before) | set(after)
        parts = []
        for k, names in enumerate(stages):
            blocks = sum(1 for name in names if name not in ends)
            symbols = (["E"] if k == 0 else []) + ([f"t*{blocks}" if blocks > 1 else "t"] if blocks else []) \
                + (["L"] if k == len(stages) - 1 else [])
            parts.append(",".join(symbols))
        layout = "|".join(parts)
    return {"pipeline_model_parallel_size": ranks, "pipeline_model_parallel_layout": layout,
            "notes": [f"pipeline_model_parallel_layout: {why}"] if why else []}


def format_lines(torchtitan: dict[str, Any], megatron: dict[str, Any]) -> list[str]:
    """The two forms as the lines ``vpipe plan`` prints: TOML for torchtitan, flags for Megatron."""
    lines = ["torchtitan, [parallelism] of the job config:"]
    for key, value in torchtitan.items():
        if key != "notes" and value is not None:
            lines.append(f"  {key} = {json.dumps(value)}")
    lines += [f"  # not written: {note}" for note in torchtitan["notes"]]
    layout = megatron["pipeline_model_parallel_layout"]
    if layout is not None:
        lines.append(f"Megatron-LM: --pipeline-model-parallel-size {megatron['pipeline_model_parallel_size']} "
                     f"--pipeline-model-parallel-layout \"{layout}\"")
    lines += [f"Megatron-LM: not written: {note}" for note in megatron["notes"]]
    return lines
