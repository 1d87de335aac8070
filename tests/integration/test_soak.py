"""The soak benchmark, short: a few hundred steps of constant moves and policy changes lose nothing.

The RSS target (< 2% growth over the second half) is the full benchmark's figure
(``python benchmarks/soak.py``), not asserted here: a short run is mostly warm-up.
"""

from __future__ import annotations

import sys

from support.processes import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import soak  # noqa: E402 - benchmarks/ is not a package


def test_short_soak_keeps_the_reference_parameters_and_empties_the_host_pool():
    result = soak.soak(steps=160, every=4, sample_every=10)
    assert result["forced_plans"] == 39
    assert result["params_equal_reference"], result["mismatched_params"]
    for rank in result["ranks"]:
        assert rank["plans_applied"] == 39  # every forced plan was applied on both ranks
        assert rank["pool_peak_bytes"] > 0  # swaps went through the host pool ...
        assert rank["pool_used_end_bytes"] == 0  # ... and every swapped byte came back
        assert rank["pool_capacity_end_bytes"] == rank["pool_capacity_mid_bytes"]  # the pool stopped growing
