"""The vpipe laboratory: everything around the library that a trainer never imports.

The ``vpipe`` command's ``demo``, ``train``, ``nas``, ``logs``, ``plot`` and ``bench``; the
launcher, reference trainer and models, the paper-sized model zoo, the simulator and its
calibration, run measurement (:mod:`.runtime`); and the report that regenerates the
README's and docs' tables from ``docs/results`` (:mod:`.report`). It needs the ``lab``
extra (``pip install 'vpipe[lab]'``: rich for its tables) and, for plots, ``plot``.
"""
