"""Two attaches' timeline windows in one process: each takes only its own wrapper off torch's p2p wait."""

from __future__ import annotations

import pytest

from vpipe.compat.torch_distributed import batch_p2p_wait
from vpipe.rank.tracing import TraceWindow


def _window(tmp_path, name: str) -> TraceWindow:
    return TraceWindow((0, 1), tmp_path / name, rank=0, stages=[0])


@pytest.mark.parametrize("first_closed", ["a", "b"])
def test_windows_closing_in_either_order_leave_torchs_wait_as_it_was(tmp_path, first_closed):
    original = batch_p2p_wait()
    assert original is not None
    windows = {"a": _window(tmp_path, "a"), "b": _window(tmp_path, "b")}
    windows["a"].begin_step(0)
    windows["b"].begin_step(0)
    assert batch_p2p_wait() is not original
    windows[first_closed].close()
    assert windows["a" if first_closed == "b" else "b"].recording
    for window in windows.values():
        window.close()
    assert batch_p2p_wait() is original
    assert not any(w.recording for w in windows.values())


def test_a_closed_window_left_under_an_open_one_only_passes_the_wait_through(tmp_path):
    original = batch_p2p_wait()
    a, b = _window(tmp_path, "a"), _window(tmp_path, "b")
    a.begin_step(0)
    b.begin_step(0)
    a.close()  # under b's wrapper: it stays there, and waits as torch does
    below = batch_p2p_wait().__wrapped__
    assert below.vpipe_window is a and below.__wrapped__ is original

    class Work:
        waited = 0

        def wait(self) -> None:
            Work.waited += 1

    batch_p2p_wait()([Work(), Work()])  # b records the wait; a's closed wrapper passes it on to torch's
    assert Work.waited == 2
    b.close()
    assert batch_p2p_wait() is original
