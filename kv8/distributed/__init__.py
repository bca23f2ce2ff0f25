"""Tensor parallelism's mechanism on torch.distributed: one model over several processes (or machines).

* :mod:`kv8.distributed.config` -- the options (:class:`ParallelConfig`).
* :mod:`kv8.distributed.group` -- a rank's group: the all-reduce (shared memory or gloo) and the control channel (a
  store).
* :mod:`kv8.distributed.shard` -- which heads and columns a rank holds; the group a model is built for.
* :mod:`kv8.distributed.launcher` -- the rank processes (started by kv8, or torchrun's) and their threads.

What a rank runs -- loading its shard and its step loop -- is the engine's: :mod:`kv8.engine.worker`.
"""
