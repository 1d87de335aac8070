"""Readers of torchtitan's and Megatron-LM's pipeline split settings, written from their documented rules.

They are the tests' independent view of what those frameworks do with the settings
``vpipe plan`` prints; nothing here imports vpipe.

torchtitan (``[parallelism]`` of its job config):

- ``module_fqns_per_model_part``: one list of module names per stage. Its splitter keeps, for
  each stage, the model's top-level children it names; a top-level ``nn.ModuleList`` /
  ``nn.ModuleDict`` keeps the entries named ``child.key``; a child not named is dropped.
- ``pipeline_parallel_first_stage_less_layers`` / ``..._last_stage_less_layers`` (without the
  list, for its own models): with ``S`` stages and ``N`` layers the embedding counts as
  ``first`` layers and norm + output as ``last``; stage ``k`` gets ``(N + first + last) // S``,
  one more for ``k < (N + first + last) % S``, less ``first`` on stage 0 and ``last`` on the
  last stage, layers handed out in order until none are left. It refuses more stages than
  ``N + first + last``, zero per stage, and ``first`` or ``last`` over the per-stage count.
- stages per rank: looped (``rank r`` runs ``r, r + W, ...``) or, for ZBV and DualPipeV, a V
  (``rank r`` runs ``r`` and ``2W - 1 - r``).

Megatron-LM (``--pipeline-model-parallel-layout``): commas are dropped, ``(pattern)*N`` and
``x*N`` unrolled, stages split at ``|``; symbols ``E`` embedding, ``t`` decoder layer, ``m``
MTP, ``L`` loss; the number of stages is a multiple of ``--pipeline-model-parallel-size``
``P``, stage ``i`` runs on rank ``i % P``; the first symbol is ``E`` and the last ``L``, each
exactly once, and the ``t`` count is the model's number of layers.
"""

from __future__ import annotations

import re

from torch import nn


def torchtitan_split(model: nn.Module, fqns_per_part: list[list[str]]) -> list[list[str]]:
    """For each part, the modules torchtitan's splitter keeps, in model order."""
    parts = []
    for names in fqns_per_part:
        wanted = set(names)
        kept = []
        for child_name, child in model.named_children():
            if isinstance(child, nn.ModuleList | nn.ModuleDict):
                keys = {n.split(".", 1)[1] for n in wanted if n.startswith(child_name + ".")}
                kept += [f"{child_name}.{key}" for key in child._modules if key in keys]
            elif child_name in wanted:
                kept.append(child_name)
        parts.append(kept)
    return parts


def torchtitan_layers_per_stage(num_stages: int, num_layers: int, first: int, last: int) -> list[int]:
    """Layers each stage gets from torchtitan's own split; ValueError where torchtitan refuses."""
    if num_stages == 1:
        return [num_layers]
    effective = num_layers + first + last
    per, extra = divmod(effective, num_stages)
    if num_stages > effective or per == 0 or first > per or last > per:
        raise ValueError("torchtitan refuses these numbers")
    out, left = [], num_layers
    for k in range(num_stages):
        share = per + (k < extra) - (first if k == 0 else last if k == num_stages - 1 else 0)
        take = min(max(share, 0), left)
        out.append(take)
        left -= take
    return out


def torchtitan_stage_ranks(schedule: str, num_stages: int, ranks: int) -> list[int]:
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return [v if v < ranks else 2 * ranks - 1 - v for v in range(num_stages)]
    return [v % ranks for v in range(num_stages)]


def megatron_layout(layout: str, size: int, num_layers: int) -> list[list[str]]:
    """The stages' symbols; AssertionError where Megatron refuses the string."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = [list(stage) for stage in text.split("|")]
    flat = [s for stage in stages for s in stage]
    assert set(flat) <= set("EtmL"), f"unknown symbols in {layout!r}"
    assert len(stages) % size == 0, f"{len(stages)} stages on {size} ranks"
    assert flat[0] == "E" and flat[-1] == "L" and flat.count("E") == 1 and flat.count("L") == 1
    assert flat.count("t") == num_layers
    return stages
