"""Tensor parallelism on torch.distributed: one model over several processes (or machines).

* :mod:`kv8.distributed.group` -- a rank's group: the all-reduce (gloo) and the control channel (a store).
* :mod:`kv8.distributed.shard` -- which heads and columns a rank holds; the group a model is built for.
* :mod:`kv8.distributed.launcher` -- start the ranks (spawned processes, or torchrun's), and stop them.
* :mod:`kv8.distributed.worker` -- the loop of ranks 1..N-1: receive a step's inputs, run their shard.
"""
