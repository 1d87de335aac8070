"""vpipe on one rank: the parts ``vpipe.attach`` wires together, one job each.

- :mod:`.config`: what the user asked for (:class:`VpipeConfig`), validated;
- :mod:`.agreement`: what every rank must agree on through the rendezvous store (block
  layouts, layer edits, the run's control-plane key), in a namespace per attach (and pipeline);
- :mod:`.replicas`: data-parallel replicas of the pipeline in a mesh: one planner, the same plan at
  the same step on every replica;
- :mod:`.memory`: each stage's budget for saved activations once its fixed bytes are paid;
- :mod:`.boundary`: when a plan takes effect (the same step on every rank);
- :mod:`.applying`: what taking effect means (policies, moves, the bookkeeping after them);
- :mod:`.steps`: the step wrapper and the micro-batch counter of hand-written loops;
- :mod:`.edits`: adding and removing layers while training runs;
- :mod:`.state`: vpipe's part of a checkpoint.
"""
