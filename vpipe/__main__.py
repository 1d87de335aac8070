"""``python -m vpipe``: the command line (also what torchrun and the spawner start)."""

import sys

from vpipe.cli import main

code = main()
if "torch.distributed" in sys.modules:  # skip torch's slow interpreter shutdown; see exit_now
    from vpipe.runtime.launch import exit_now

    exit_now(int(code or 0))
sys.exit(code)
