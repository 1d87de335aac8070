"""``python -m vpipe.report``: see :mod:`vpipe.report`."""

import sys

from vpipe.report.command import main

if __name__ == "__main__":
    sys.exit(main())
