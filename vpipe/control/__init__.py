"""Control plane: pyzmq sockets and validated msgpack messages between stages and the planner daemon.

Nothing here imports torch except :mod:`vpipe.control.session`, so the planner daemon
starts quickly.
"""
