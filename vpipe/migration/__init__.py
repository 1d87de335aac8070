"""Layer managers: moving blocks between neighbouring stages while training runs.

What a stage *is* (its blocks, pins, optimizers, wrappers) lives in :mod:`vpipe.stage`; this
package holds what moves blocks:

- :mod:`.layer_manager`: one rank's placement and the rounds that change it;
- :mod:`.block_edits`: a block taken out, put in or dropped, with every part that follows it told;
- :mod:`.placement`, :mod:`.rounds`: a plan diffed into rounds of neighbour moves, and one round run;
- :mod:`.handshake`, :mod:`.messages`, :mod:`.link`: the prepare / ready / transfer / ack exchange;
- :mod:`.cloning`: building an arriving block from a local block of its kind (or the factory);
- :mod:`.state`, :mod:`.transfer`: parameters, buffers, gradients and optimizer state as one payload;
- :mod:`.stream`: moves streamed into a running PipeDream stream;
- :mod:`.shapes`: what torch's pipelining must infer again after a move;
- :mod:`.stale`: references a move leaves behind, named in one log line.
"""
