"""What a stage is: read once at attach, handed to the parts that measure, plan and move.

- :mod:`.pipeline`: the trainer's schedule (one stage per rank or several) or plain module,
  read as the stages this rank runs, and what torch's pipelining needs redone;
- :mod:`.blocks`: the stage's container of repeated blocks and their keys;
- :mod:`.kinds`: which blocks are interchangeable (a clone may be built from one of its kind);
- :mod:`.pins`: blocks that never move (shared modules, user hooks);
- :mod:`.optimizers`, :mod:`.groups`: one optimizer per model part, and the param group a
  parameter joins;
- :mod:`.compiled`, :mod:`.fsdp`: blocks compiled in place, FSDP2 blocks and their stage's root.
"""
