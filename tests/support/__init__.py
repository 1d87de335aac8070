"""Helpers the tests share: processes and runs, results, graphs, the
control plane, migration, tensor managers.

``tests/`` is on ``sys.path`` (pytest puts the directory of the root ``conftest.py`` there, and
:func:`support.processes.child_env` puts it on the ``PYTHONPATH`` of every child), so tests and
the rank programs in ``tests/workers/`` import ``support.<module>``.
"""
