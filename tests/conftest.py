"""The suite's settings: repeatable property tests, one thread per test. Helpers live in ``support/``."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from vpipe.settings import process_settings

# Property tests draw the same examples on every run (CI included): a property that fails, fails for
# everyone, not by the luck of the draw. VPIPE_HYPOTHESIS_PROFILE=default explores new examples.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.load_profile(os.environ.get("VPIPE_HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _settings_read_per_test():
    """vpipe reads its VPIPE_* variables once per process: each test reads them as a new process would, so a
    test that sets one (monkeypatch.setenv) before it first asks sees it, and leaves nothing to the next."""
    process_settings.cache_clear()
    yield
    process_settings.cache_clear()
