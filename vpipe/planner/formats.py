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

**DeepSpeed** (``deepspeed.pipe.PipelineModule(layers=..., partition_method=...)``) splits
its list of layers by a rule, never by names: ``uniform`` (the same number of layers per
stage, the first ones one more), ``parameters`` (its balanced linear partition of the
layers' trainable parameter counts, the default) or ``type:REGEX`` (the same over 1 for each
layer whose class matches, 0 otherwise). vpipe writes the method whose rule gives the
planned split when the layer list is the model's units in order (embedding, blocks, norm,
head, one ``LayerSpec`` each), and says which split each rule would give where none does.
DeepSpeed runs one stage per rank with its own 1F1B schedule.

Torch-free: it reads the plan's module names, which units are blocks, and (DeepSpeed) their
classes and parameter counts.
"""

from __future__ import annotations

import json
from typing import Any

from vpipe.graph import Unit

__all__ = ["torchtitan_form", "megatron_form", "deepspeed_form", "TORCHTITAN_SCHEDULES", "format_lines",
           "torchtitan_counts", "uniform_bounds", "balanced_bounds"]

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
        return (before, after,
                (f"the model has no module {'before' if not before else 'after'} its blocks to be the "
                               "embedding and the head"))
    if before and not set(before) <= set(stages[0]):
        return (before, after,
                f"the modules before the blocks ({', '.join(before)}) are not all on the first stage")
    if after and not set(after) <= set(stages[-1]):
        return (before, after,
                f"the modules after the blocks ({', '.join(after)}) are not all on the last stage")
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
    """torchtitan's ``[parallelism]`` fields for the plan; a field
    it cannot express is None, with a note why."""
    notes: list[str] = []
    deep = [u.name for u in units if "." in (u.name if u.container is None else u.container)]
    fqns = None if deep else [list(names) for names in stages]
    if deep:
        notes.append("module_fqns_per_model_part: torchtitan splits only top-level children and the entries "
                     f"of top-level ModuleList/ModuleDict containers; {deep[0]} is deeper")
    blocks = [sum(1 for name in names if name in {u.name for u in units if u.container is not None})
              for names in stages]
    _, _, why = _ends(stages, units)
    if deep and why is None:
        why = "torchtitan's own split is for models it can split by module names (see above)"
    less = None if why else _less_layers(blocks, stages_per_rank, schedule)
    if less is None:
        notes.append("first/last_stage_less_layers: " + (why or f"no pair gives blocks per stage "
                                                                f"{','.join(map(str, blocks))} "
                                                                f"with {stages_per_rank} stage(s) per rank"))
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
    """Megatron's ``--pipeline-model-parallel-size`` and ``--pipeline-model-parallel-layout`` (None, with a
    note why, where the plan cannot be written as one)."""
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


def uniform_bounds(num_layers: int, num_stages: int) -> list[int]:
    """Stage boundaries (``num_stages + 1`` layer indices) of DeepSpeed's
    ``uniform`` method: equal counts, the first ``num_layers % num_stages`` stages
    one more; with fewer layers than stages, one layer per stage."""
    if num_layers <= num_stages:
        return [min(k, num_layers) for k in range(num_stages + 1)]
    per, extra = divmod(num_layers, num_stages)
    return [k * per + min(k, extra) for k in range(num_stages + 1)]


def balanced_bounds(weights: list[int], num_stages: int) -> list[int]:
    """Stage boundaries of DeepSpeed's balanced linear partition
    (``parameters`` and ``type:``), as 0.19.8 makes it.

    Its dynamic programme extends, for every prefix of ``i`` layers in ``j`` stages, the
    chosen ``j - 1``-stage split of a shorter prefix by one last stage, keeping the extension
    whose spread (heaviest stage minus lightest, of that split and the new stage) is smallest,
    the longest shorter prefix among equals. It is not the split with the lightest heaviest
    stage, so the rule is followed as it is, ties included.
    """
    n = len(weights)
    if n <= num_stages:
        return uniform_bounds(n, num_stages)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i] = (spread, heaviest, lightest, where the last stage starts) of prefix i in j stages
    best: list[list[tuple[float, float, float, int] | None]] = [[None] * (n + 1)
                                                                for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_stages) + 1):
            chosen = None
            for k in range(j - 1, i):
                before = best[j - 1][k]
                if before is None:
                    continue
                last = prefix[i] - prefix[k]
                heaviest, lightest = max(before[1], last), min(before[2], last)
                if chosen is None or heaviest - lightest <= chosen[0]:
                    chosen = (heaviest - lightest, heaviest, lightest, k)
            best[j][i] = chosen
    bounds = [n]
    for j in range(num_stages, 0, -1):
        entry = best[j][bounds[-1]]
        assert entry is not None
        bounds.append(entry[3])
    return bounds[::-1]


def deepspeed_form(stages: list[list[str]], units: list[Unit], schedule: str,
                   stages_per_rank: int) -> dict[str, Any]:
    """The ``partition_method`` that makes DeepSpeed's ``PipelineModule`` split the model's units as
    planned (None, with a note saying what each method would give instead, where none does)."""
    bounds = [0]
    for names in stages:
        bounds.append(bounds[-1] + len(names))
    notes: list[str] = []
    if stages_per_rank != 1:
        notes.append(f"partition_method: DeepSpeed runs one stage per rank, the plan {stages_per_rank}")
        return {"partition_method": None, "parts": bounds, "notes": notes}
    if schedule != "1f1b":
        notes.append(f"schedule: DeepSpeed runs its own 1F1B; the plan was made for {schedule}")
    if [u.name for u in units] != [name for names in stages for name in names]:
        notes.append("partition_method: the plan does not keep the units in model order")
        return {"partition_method": None, "parts": bounds, "notes": notes}
    gives: dict[str, list[int]] = {}
    if all(u.params is not None for u in units):
        gives["parameters"] = balanced_bounds([u.params or 0 for u in units], len(stages))
    gives["uniform"] = uniform_bounds(len(units), len(stages))
    kinds = {u.kind for u in units if u.container is not None}
    kind = kinds.pop() if len(kinds) == 1 else None
    if kind is not None:  # DeepSpeed matches the regex anywhere in a layer's class name, ignoring case
        others = {u.kind or "" for u in units if u.container is None}
        if all(kind.lower() not in other.lower() for other in others):
            gives[f"type:{kind}"] = balanced_bounds([int(u.container is not None) for u in units],
                                                    len(stages))
    method = next((m for m, b in gives.items() if b == bounds), None)
    if method is None:
        tried = "; ".join(f"{m} gives {b}" for m, b in gives.items())
        why = "" if "parameters" in gives else " (parameters: classes and counts are measured with --model)"
        notes.append(f"partition_method: no method gives the planned parts {bounds}: {tried}{why}")
    return {"partition_method": method, "parts": bounds, "notes": notes}


def format_lines(torchtitan: dict[str, Any], megatron: dict[str, Any],
                 deepspeed: dict[str, Any] | None = None) -> list[str]:
    """The forms as the lines ``vpipe plan`` prints: TOML for torchtitan, flags for Megatron, DeepSpeed's
    ``PipelineModule`` argument."""
    lines = ["torchtitan, [parallelism] of the job config:"]
    for key, value in torchtitan.items():
        if key != "notes" and value is not None:
            lines.append(f"  {key} = {json.dumps(value)}")
    lines += [f"  # not written: {note}" for note in torchtitan["notes"]]
    layout = megatron["pipeline_model_parallel_layout"]
    if layout is not None:
        lines.append("Megatron-LM: --pipeline-model-parallel-size "
                     f"{megatron['pipeline_model_parallel_size']} "
                     f"--pipeline-model-parallel-layout \"{layout}\"")
    lines += [f"Megatron-LM: not written: {note}" for note in megatron["notes"]]
    if deepspeed is not None:
        if deepspeed["partition_method"] is not None:
            lines.append("DeepSpeed: PipelineModule(..., "
                         f"partition_method=\"{deepspeed['partition_method']}\") "
                         f"(parts {deepspeed['parts']})")
        lines += [f"DeepSpeed: not written: {note}" for note in deepspeed["notes"]]
    return lines
