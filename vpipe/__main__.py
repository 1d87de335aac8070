"""``python -m vpipe``: the command line (also what torchrun and the spawner start)."""

import sys

from vpipe.cli import main

sys.exit(main())
