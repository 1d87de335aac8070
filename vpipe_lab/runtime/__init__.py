"""The reference side of vpipe, which the library never imports.

The launcher (``spawn``, torchrun ranks) and its watchdog, the reference trainer and
models behind ``vpipe train``/``demo``/``nas``, single-process references a pipeline must
reproduce, the simulator and its calibration, measurement of runs, and the paper-sized
model graphs the planner is tested and benchmarked on (:mod:`.zoo`).
"""
