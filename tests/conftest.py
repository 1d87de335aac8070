"""The suite's settings: repeatable property tests, one thread per test. Helpers live in ``support/``."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (CI included): a property that fails, fails for
# everyone, not by the luck of the draw. VPIPE_HYPOTHESIS_PROFILE=default explores new examples.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.load_profile(os.environ.get("VPIPE_HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield
