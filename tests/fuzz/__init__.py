"""A differential fuzzer: random trainers run with and without vpipe side by side must learn the same thing.

``draws`` picks a feature combination per seed, ``models`` and ``trainer`` build and train it,
``compare`` judges the two copies, ``rank_program`` runs many draws in one job of ranks, and
``run`` is the command that launches jobs and summarises (``python tests/fuzz/run.py --help``).
"""
