"""What vpipe makes is this user's alone whatever the umask: files
``0600``, directories ``0700``, as the key files are.

Under a umask of 000, checkpoints, results, timelines and run logs were ``0666`` and the directories vpipe
made ``0777``; ``vpipe keys`` made a missing parent directory ``0777``. A run of ``vpipe train`` under umask
000 is checked in ``tests/integration/test_run_outputs.py``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


def test_vpipe_keys_makes_a_missing_parent_0700_whatever_the_umask(tmp_path, capsys):
    from vpipe.cli import main

    old = os.umask(0)
    try:
        assert main(["keys", str(tmp_path / "a" / "b" / "keys"), "--name", "host"]) == 0
    finally:
        os.umask(old)
    assert {name: oct(mode) for name, mode in _modes(tmp_path / "a").items()} == {
        ".": "0o700",
        "b": "0o700",
        "b/keys": "0o700",
        "b/keys/host.key": "0o644",
        "b/keys/host.key_secret": "0o600",
    }


def test_what_the_library_writes_is_private_whatever_the_umask(tmp_path):
    """In-process, every writer: the timeline, a run log, a checkpoint, a command's output."""
    import torch

    from vpipe import log, timeline
    from vpipe.checkpoint import save_checkpoint
    from vpipe.files import write_output

    class Store(dict):
        def set(self, key, value):
            self[key] = value.encode()

        def multi_get(self, keys):
            return [self[k] for k in keys]

    old = os.umask(0)
    try:
        timeline.start(0, tmp_path / "w" / "trace", [0])
        timeline.stop()
        run_log = log.RunLog(tmp_path / "w" / "logs" / "run.log", rank=0)
        log.decision("plan", "one")
        run_log.close()
        save_checkpoint(tmp_path / "w" / "ck", 1, module=torch.nn.Sequential(torch.nn.Linear(2, 2)),
                        optimizer=None,
                        rank=0, world_size=1, store=Store(),
                        vpipe_state={"version": 1, "epoch": 0, "iteration": 1,
                                                                          "stages": [[0]], "policies": {},
                                                                          "next_layer_id": 1})
        write_output(tmp_path / "w" / "trace.json", b"{}", "-o")
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "w")
    # ., trace, its file, logs, run.log, ck, the step, shard, manifest, -o
    assert len(modes) == 10, sorted(modes)
    assert {n: oct(m) for n, m in modes.items() if m != (0o700 if (tmp_path / "w" / n).is_dir()
                                                         else 0o600)} == {}
