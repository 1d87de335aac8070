"""A trainer of your own that dies of an uncaught exception with vpipe attached: vpipe's exit handler
detaches at once, where the last stage used to wait 5 s for statistics its upstream could not send (the
upstream is blocked on it in the pipeline until its process is gone)."""

from __future__ import annotations

import json
import sys

from support.processes import WORKERS, child_env, warm_starter


def test_the_last_stage_leaves_at_once_after_an_uncaught_exception(tmp_path, capfd):
    from vpipe_lab.runtime.launch import spawn

    out = tmp_path / "crash"
    code = spawn([sys.executable, str(WORKERS / "crash_worker.py"), str(out)], 2, extra_env=child_env(),
                 timeout_s=120, starter=warm_starter())
    err = capfd.readouterr().err
    assert code != 0 and "rank 1: the trainer's own bug" in err, err[-3000:]
    last = json.loads((tmp_path / "crash.rank1.json").read_text())
    assert last["vpipe_gone"] - last["raised"] < 2.0, last  # 0.02 s; it was 5.0 s
    assert "did not finish its stats" not in err  # `stage 1: stage 0 did not finish its stats within 5 s`
