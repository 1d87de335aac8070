"""Cost model of a pipeline stage and of a whole pipeline step (vPipe eqs. 1-3).

Everything the planner decides is judged here, so the rules are stated once:

*Time of a stage, per micro-batch* = sum of its layers' ``fwd + bwd`` + ``fwd`` again for
every recomputed (R) layer + the part of its swap traffic the copy link cannot hide + the
time to receive its boundary tensors.

- Swap (S): each swapped layer's activations cross the copy link twice per micro-batch (out
  after the forward, back before the backward), ``2 * act_bytes``. In steady state a stage
  spends its compute time (``fwd + bwd + recompute``) per micro-batch, and the copy link
  runs beside it, so only ``max(0, swap_bytes / copy_bw - compute)`` is exposed (eq. 2).
- Communication: the tensors crossing a boundary are charged to the stage that receives
  them: the forward input of stage k and the gradient of its output. A tensor crosses a
  boundary once however many layers beyond it consume it, so boundary bytes are counted
  per source tensor (the largest of its crossing edges), and a skip edge spanning several
  stages is relayed through, and charged to, every boundary it spans.
- Collectives inside a layer (a tensor-parallel block's all-reduces, an FSDP2 block's
  all-gathers) are part of its measured ``fwd`` / ``bwd``: the monitors time the block's
  forward and backward whole, and the planner hears, per stage, the slowest of the ranks that
  run it (its tp and dp peers), so a recompute re-pays them in ``fwd`` and no term of its own
  is needed. A layer's bytes are this rank's shards (DTensors count their local part).

*Memory of stage k* = ``param_bytes * (versions + optimizer_factor)`` + ``in_flight *
resident`` + ``swap_staging``, where

- ``versions`` is 1, or ``p - k`` stashed weight versions for PipeDream (weights only: the
  optimizer state exists once), and ``optimizer_factor`` defaults to 2 (Adam's moments);
- ``in_flight`` is the number of micro-batches whose activations a stage holds at peak:
  GPipe ``m``, 1F1B ``min(p - k, m)``, PipeDream ``p - k`` (vPipe eq. 1, k from 0);
- a kept (D) layer holds its ``act_bytes`` for every in-flight micro-batch; a recomputed (R)
  layer holds only its input (the checkpoint), ``in_bytes`` per in-flight micro-batch — we
  do not credit that the producer may keep the same storage, so R is priced conservatively;
  a swapped (S) layer holds one micro-batch's activations (the copy being written out or
  prefetched back), independent of ``in_flight``.

The schedule rules (in-flight micro-batches, weight versions, step time, the hardware) are
in :mod:`vpipe.planner.setup`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vpipe.graph import LayerGraph
from vpipe.plan import Policy
from vpipe.planner.setup import (
    MULTI_STAGE,
    SCHEDULES,
    Code,
    Hardware,
    PipelineSetup,
    Schedule,
    check_schedule,
    in_flight,
    pipeline_step_time,
    throughput,
    weight_versions,
)

__all__ = [
    "SCHEDULES",
    "MULTI_STAGE",
    "Schedule",
    "Hardware",
    "PipelineSetup",
    "GraphProfile",
    "StageCosts",
    "CoarseCosts",
    "Code",
    "check_schedule",
    "in_flight",
    "weight_versions",
    "stage_time",
    "stage_memory",
    "pipeline_step_time",
    "throughput",
    "segment_of",
]


# --------------------------------------------------------------------- per-graph arrays
class GraphProfile:
    """A graph's per-layer costs as numpy arrays in execution order, plus boundary bytes.

    ``cut[c]`` is the bytes crossing the boundary between positions ``c - 1`` and ``c``
    (``cut[0] = cut[n] = 0``); ``in_bytes[i]`` the bytes of layer i's inputs, which is what a
    recomputed layer keeps. Built once per graph in O(n + E).
    """

    def __init__(self, graph: LayerGraph) -> None:
        nodes = graph.nodes
        n = len(nodes)
        self.graph = graph
        self.n = n
        self.ids: list[int] = [node.id for node in nodes]
        self.fwd = np.array([node.fwd_s for node in nodes], dtype=float)
        self.bwd = np.array([node.bwd_s for node in nodes], dtype=float)
        self.act = np.array([node.act_bytes for node in nodes], dtype=float)
        self.params = np.array([node.param_bytes for node in nodes], dtype=float)
        pos = {node.id: i for i, node in enumerate(nodes)}
        # edges as positions, one row per (source, consumer) pair with the largest bytes
        raw = np.array([(pos[s], pos[d], b) for s, d, b in graph.edges], dtype=np.int64).reshape(-1, 3)
        order = np.lexsort((-raw[:, 2], -raw[:, 1], raw[:, 0]))  # by source, consumer descending
        raw = raw[order]
        keep = np.ones(len(raw), dtype=bool)
        keep[1:] = (raw[1:, 0] != raw[:-1, 0]) | (raw[1:, 1] != raw[:-1, 1])
        src, dst, nbytes = raw[keep, 0], raw[keep, 1], raw[keep, 2]
        self.edge_src, self.edge_dst = src, dst
        self.in_bytes = np.bincount(dst, weights=nbytes.astype(float), minlength=n).astype(float)
        self.cut = _boundary_bytes(n, src, dst, nbytes)
        self.num_edges = len(graph.edges)

    def position(self, node_id: int) -> int:
        return self.graph.position(node_id)

    def codes_from(self, policies: Mapping[int, Policy]) -> np.ndarray:
        codes = np.zeros(self.n, dtype=np.int8)
        for lid, pol in policies.items():
            codes[self.position(lid)] = Code.of(pol)
        return codes

    def policies_from(self, codes: np.ndarray) -> dict[int, Policy]:
        by_code = (Policy.KEEP, Policy.SWAP, Policy.RECOMPUTE)
        return dict(zip(self.ids, (by_code[c] for c in codes.tolist())))

    def cuts_of(self, stages: Sequence[Sequence[int]]) -> list[int]:
        """Boundary positions of a contiguous partition given as lists of node ids."""
        bounds, start = [], 0
        for k, layers in enumerate(stages):
            positions = [self.position(lid) for lid in layers]
            if not positions or positions != list(range(start, start + len(positions))):
                raise ValueError(f"stage {k} is not a contiguous, non-empty run of the execution order")
            start += len(positions)
            bounds.append(start)
        if start != self.n:
            raise ValueError(f"the stages hold {start} of the graph's {self.n} layers")
        return bounds[:-1]

    def stages_of(self, cuts: Sequence[int]) -> list[list[int]]:
        edges = [0, *cuts, self.n]
        return [self.ids[edges[k]:edges[k + 1]] for k in range(len(edges) - 1)]


# --------------------------------------------------------------------- segment costs
class StageCosts:
    """O(1) (and numpy-broadcast) time and memory of any contiguous segment ``[i, j)``.

    Built from prefix sums for one assignment of policies; the partitioners query it
    millions of times. ``best_case_memory`` is the memory a segment would need with every
    layer on its most frugal policy: the partitioners use it as the feasibility test when
    policies will be re-optimised afterwards (the SRP loop).
    """

    def __init__(self, profile: GraphProfile, setup: PipelineSetup, codes: np.ndarray | None = None) -> None:
        self.profile, self.setup = profile, setup
        codes = np.zeros(profile.n, dtype=np.int8) if codes is None else np.asarray(codes, dtype=np.int8)
        self.codes = codes
        hw = setup.hardware
        is_s, is_r = codes == Code.S, codes == Code.R
        compute = profile.fwd + profile.bwd + np.where(is_r, profile.fwd, 0.0)
        swap = np.where(is_s, 2.0 * profile.act, 0.0) / hw.copy_bytes_per_s
        if not hw.copies_overlap:  # the copies run on the compute thread: their time adds to the stage's
            compute, swap = compute + swap, np.zeros_like(swap)
        self.compute_prefix = _prefix(compute)
        self.swap_prefix = _prefix(swap)
        self.resident_prefix = _prefix(np.where(is_r, profile.in_bytes, np.where(is_s, 0.0, profile.act)))
        self.staging_prefix = _prefix(np.where(is_s, profile.act, 0.0))
        self.param_prefix = _prefix(profile.params)
        self.comm = profile.cut / hw.net_bytes_per_s
        self.has_swaps = bool(self.swap_prefix[-1] > 0)
        self.speeds = setup.speeds()  # per stage, the device's compute time relative to the reference
        self._memory_prefix: dict[tuple[int, bool], np.ndarray] = {}

    @property
    def n(self) -> int:
        return self.profile.n

    @property
    def cut(self) -> np.ndarray:
        """Bytes crossing each boundary position (``cut[0] = cut[n] = 0``)."""
        return self.profile.cut

    def compute(self, i, j):  # noqa: ANN001, ANN201 - ints or numpy arrays
        return self.compute_prefix[j] - self.compute_prefix[i]

    def time(self, i, j, stage=None):  # noqa: ANN001, ANN201
        """Seconds per micro-batch of the stage ``[i, j)`` (eq. 2 plus boundary receives), on stage number
        ``stage``'s device (ints or arrays; None: the reference device)."""
        c = self.compute_prefix[j] - self.compute_prefix[i]
        if stage is not None:
            c = c * self.speeds[stage]
        if self.has_swaps:
            c = c + np.maximum(0.0, (self.swap_prefix[j] - self.swap_prefix[i]) - c)
        return c + self.comm[i] + self.comm[j]

    def memory_prefix(self, stage: int, best_case: bool = False) -> np.ndarray:
        """``P`` with ``memory(i, j, stage) == P[j] - P[i]`` (eq. 1 is a sum over layers).

        With ``best_case`` every layer is priced on the policy that holds least: the
        partitioners' feasibility test when policies are re-optimised afterwards (SRP loop)."""
        key = (stage, best_case)
        cached = self._memory_prefix.get(key)
        if cached is not None:
            return cached
        s, m = self.setup, self.setup.in_flight(stage)
        if best_case:
            p = self.profile
            held = _prefix(np.minimum(p.act, m * p.in_bytes))  # S holds one copy, R its input; D never less
        else:
            held = m * self.resident_prefix + self.staging_prefix
        out = self._memory_prefix[key] = s.param_factor(stage) * self.param_prefix + held
        return out

    def memory(self, i, j, stage: int):  # noqa: ANN001, ANN201 - ints or numpy arrays
        """Bytes the stage ``[i, j)`` holds at peak as stage number ``stage`` (eq. 1)."""
        prefix = self.memory_prefix(stage)
        return prefix[j] - prefix[i]

    def best_case_memory(self, i, j, stage: int):  # noqa: ANN001, ANN201
        """Memory of ``[i, j)`` with each layer on the policy that holds least."""
        prefix = self.memory_prefix(stage, best_case=True)
        return prefix[j] - prefix[i]

    def stage_times(self, cuts: Sequence[int]) -> np.ndarray:
        b = np.array([0, *cuts, self.n])
        return np.asarray(self.time(b[:-1], b[1:], np.arange(b.size - 1)), dtype=float)

    def stage_memory(self, cuts: Sequence[int]) -> np.ndarray:
        b = [0, *cuts, self.n]
        return np.array([self.memory(b[k], b[k + 1], k) for k in range(len(b) - 1)], dtype=float)

    def comm_bytes(self, cuts: Sequence[int]) -> int:
        return int(round(sum(self.cut[c] for c in cuts)))


class CoarseCosts(StageCosts):
    """The same costs seen only at some boundary ``positions`` (0 and n among them).

    Position ``c`` of the view is boundary ``positions[c]`` of the full graph, so a partition
    of the view is a partition of the graph whose cuts all lie on ``positions``, priced
    exactly: every term of a stage is a prefix difference or a boundary term, and those
    are sampled, not approximated. The exact partitioners run on it unchanged, which is
    how the planner solves the coarse chain of Alg. 3 optimally in O(coarse nodes^2).
    """

    def __init__(self, costs: StageCosts, positions: np.ndarray) -> None:  # a view: no prefix sums of its own
        positions = np.asarray(positions, dtype=np.int64)
        if (
            positions.size < 2
            or positions[0] != 0
            or positions[-1] != costs.n
            or np.any(np.diff(positions) <= 0)
        ):
            raise ValueError("positions must rise strictly from 0 to the number of layers")
        self.base, self.positions = costs, positions
        self.profile, self.setup, self.codes = costs.profile, costs.setup, costs.codes
        self.compute_prefix = costs.compute_prefix[positions]
        self.swap_prefix = costs.swap_prefix[positions]
        self.resident_prefix = costs.resident_prefix[positions]
        self.staging_prefix = costs.staging_prefix[positions]
        self.param_prefix = costs.param_prefix[positions]
        self.comm = costs.comm[positions]
        self.has_swaps = costs.has_swaps
        self.speeds = costs.speeds
        self._cut = costs.cut[positions]
        self._memory_prefix = {}

    @property
    def n(self) -> int:
        return self.positions.size - 1

    @property
    def cut(self) -> np.ndarray:
        return self._cut

    def memory_prefix(self, stage: int, best_case: bool = False) -> np.ndarray:
        key = (stage, best_case)
        if key not in self._memory_prefix:
            self._memory_prefix[key] = self.base.memory_prefix(stage, best_case)[self.positions]
        return self._memory_prefix[key]

    def full_cuts(self, cuts: Sequence[int]) -> list[int]:
        """The graph's boundary positions of cuts made in this view."""
        return [int(self.positions[c]) for c in cuts]


def _boundary_bytes(n: int, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Bytes crossing each boundary, a source's tensor counted once per boundary.

    Rows are sorted by source, then consumer descending. Boundary ``c`` (``src < c <= dst``)
    carries, for each source, the largest of its edges whose consumer is at or after ``c``:
    a running maximum within each source's rows, applied to the boundaries between that
    consumer and the next nearer one."""
    cut = np.zeros(n + 1)
    if src.size == 0:
        return cut
    new_source = np.ones(src.size, dtype=bool)
    new_source[1:] = src[1:] != src[:-1]
    group = np.cumsum(new_source) - 1
    offset = group * (int(nbytes.max()) + 1)  # makes a running max restart at each source
    running = np.maximum.accumulate(nbytes + offset) - offset
    last_in_group = np.ones(src.size, dtype=bool)
    last_in_group[:-1] = new_source[1:]
    nearer = np.where(last_in_group, src, np.roll(dst, -1))  # the next nearer consumer, or the source
    lo, hi = nearer + 1, dst
    ok = lo <= hi
    diff = np.zeros(n + 2)
    np.add.at(diff, lo[ok], running[ok].astype(float))
    np.add.at(diff, hi[ok] + 1, -running[ok].astype(float))
    cut[:] = np.cumsum(diff)[: n + 1]
    cut[0] = cut[n] = 0.0
    return cut


def _prefix(values: np.ndarray) -> np.ndarray:
    out = np.zeros(values.size + 1, dtype=float)
    np.cumsum(values, out=out[1:])
    return out


# --------------------------------------------------------------------- public helpers
def segment_of(graph: LayerGraph, layer_ids: Sequence[int]) -> tuple[int, int]:
    """Positions ``[start, end)`` of a stage given as layer ids; ValueError unless it is a
    non-empty contiguous run of known layers."""
    unknown = [lid for lid in layer_ids if not graph.has(lid)]
    if unknown:
        raise ValueError(f"graph {graph.name!r} has no layer(s) {unknown[:5]}")
    positions = sorted(graph.position(lid) for lid in layer_ids)
    if not positions:
        raise ValueError("a stage needs at least one layer")
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise ValueError("a stage must be a contiguous run of the execution order")
    return positions[0], positions[-1] + 1


def stage_time(
    graph: LayerGraph,
    layer_ids: Sequence[int],
    policies: Mapping[int, Policy] | None = None,
    hardware: Hardware | None = None,
) -> float:
    """Seconds per micro-batch of the stage holding ``layer_ids`` (a contiguous run)."""
    profile = GraphProfile(graph)
    setup = PipelineSetup(num_stages=1, hardware=hardware or Hardware())
    costs = StageCosts(profile, setup, profile.codes_from(policies or {}))
    i, j = segment_of(graph, layer_ids)
    return float(costs.time(i, j))


def stage_memory(
    graph: LayerGraph,
    layer_ids: Sequence[int],
    policies: Mapping[int, Policy] | None = None,
    *,
    stage: int,
    num_stages: int,
    schedule: str = "1f1b",
    micro_batches: int = 8,
    hardware: Hardware | None = None,
) -> float:
    """Peak bytes of stage number ``stage`` holding ``layer_ids`` under ``schedule``."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
    profile = GraphProfile(graph)
    setup = PipelineSetup(num_stages, schedule, micro_batches, hardware or Hardware())
    costs = StageCosts(profile, setup, profile.codes_from(policies or {}))
    i, j = segment_of(graph, layer_ids)
    return float(costs.memory(i, j, stage))
