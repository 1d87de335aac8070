"""vpipe on one rank: the parts ``vpipe.attach`` wires together, one job each.

- :mod:`.build`: the parts built in order, all or nothing: each undo registered (:mod:`.cleanups`) the moment
  its part is made, every one run, newest first, when a later step fails or at detach;
- :mod:`.resolved`: the user's configuration (:class:`vpipe.config.VpipeConfig`) resolved on this rank: the
  budget of ``"auto"`` in bytes, the planner's configuration from the pipeline (:mod:`.config`: the
  configuration's old import path);
- :mod:`.agreement`: what every rank must agree on through the rendezvous store (block
  layouts, layer edits, the run's control-plane key), in a namespace per attach (and pipeline);
- :mod:`.replicas`: data-parallel replicas of the pipeline in a mesh: one planner, the same plan at
  the same step on every replica;
- :mod:`.memory`: each stage's budget for saved activations once its fixed bytes are paid;
- :mod:`.plan_in_force`: the plan in force and its one owner (:class:`~.plan_in_force.PlanInForce`),
  the only place that assigns it and checks a plan before it takes effect; the layer manager,
  tensor managers and control session are told of each commit;
- :mod:`.local_layers`: the blocks that never move, and the layers as the monitors report them;
- :mod:`.parts`: the parts the step driver, applier, edits and state share, as one value;
- :mod:`.boundary`: when a plan takes effect (the same step on every rank);
- :mod:`.applying`: what taking effect means (the check, moves, one commit);
- :mod:`.steps`: the step wrapper and the micro-batch counter of hand-written loops;
- :mod:`.edits`: adding and removing layers while training runs (a new epoch, committed);
- :mod:`.state`: vpipe's part of a checkpoint (a restored plan, committed).
"""
