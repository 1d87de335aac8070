"""``python -m vpipe_lab``: the ``vpipe`` command (also what torchrun and the spawner start)."""

import sys

from vpipe_lab.cli import main

code = main()
if "torch.distributed" in sys.modules:  # skip torch's slow interpreter shutdown; see exit_now
    from vpipe_lab.runtime.launch import exit_now

    exit_now(int(code or 0))
sys.exit(code)
