"""``python -m kv8.engine.rank_main --rank R --world-size N --port P``: the process of a tensor-parallel rank that
kv8 started (:func:`kv8.engine.worker.start_ranks`, :data:`kv8.engine.worker.WORKER_MODULE`); it runs
:func:`kv8.engine.worker.main`. Not for users.

A module of its own that nothing imports: ``python -m PACKAGE.MODULE`` imports the packages above the module first,
and ``import kv8`` already imports :mod:`kv8.engine.worker` (``kv8.LLM`` builds engines). Run as ``-m`` itself, the
worker module was in ``sys.modules`` before runpy executed it, so every rank printed ``RuntimeWarning:
'kv8.engine.worker' found in sys.modules after import of package 'kv8.engine'`` and ran a second copy of the
module as ``__main__``. This one is not imported by ``import kv8``, so it runs once, and the worker module once.
"""

from kv8.engine.worker import main

if __name__ == "__main__":
    main()
