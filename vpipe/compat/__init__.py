"""Where vpipe reaches into foreign libraries' private parts: one module per library (or per part of it).

A name that starts with one underscore is not a library's promise: its next release may
rename or drop it. vpipe needs a few of torch's (a container edited in place, the
autograd engine's graph task, FSDP2's root state, the pipelining schedules' stages), and
reaches them only here, each behind a small named function whose docstring says what it
is for and which torch versions it was checked against. A torch that changes one of them
then fails in one place, and the rest of vpipe reads as if it used public API.

- :mod:`.torch_internals`: torch's core (``nn.Module``, autograd, storages, copies,
  the profiler, ``torch.compile``, ``torch.utils.checkpoint``'s helpers);
- :mod:`.torch_distributed`: ``torch.distributed``'s pipelining, FSDP2 and c10d, apart
  because importing pipelining costs about a second that the spawning parent and the
  torch-free commands never pay.

``tests/integration/test_architecture.py`` fails on a private attribute touched anywhere
else in vpipe. This package imports nothing of vpipe's.
"""
