"""``python -m vpipe``: the library's command line (``plan``, ``planner``, ``keys``, ``trace``)."""

import sys

from vpipe.cli import main

sys.exit(main())
