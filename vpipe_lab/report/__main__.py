"""``python -m vpipe_lab.report``: see :mod:`vpipe_lab.report`."""

import sys

from vpipe_lab.report.command import main

if __name__ == "__main__":
    sys.exit(main())
