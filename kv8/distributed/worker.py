"""The loop of tensor-parallel ranks 1..N-1: build the config from the same options as rank 0, load the rank's
shard with rank 0's KV cache size, report ready, then run one forward per step rank 0 publishes, until it
publishes ``None`` (stop) or goes away. The worker never samples and never schedules."""

from __future__ import annotations

import argparse
import logging
import pickle
import traceback
from typing import TYPE_CHECKING

import torch.distributed as dist

from kv8.distributed.group import STORE_TIMEOUT, TPGroup

if TYPE_CHECKING:
    from kv8.engine.args import EngineArgs

__all__ = ["main", "run_worker", "worker_main"]

logger = logging.getLogger("kv8")


def run_worker(tp: TPGroup, args: EngineArgs) -> None:
    """Load the shard of ``tp.rank`` for ``args`` and serve steps until rank 0 stops."""
    from kv8.cache.layout import layout_for
    from kv8.distributed.launcher import allreduce_slot_bytes, set_threads
    from kv8.engine.engine import load_shard
    from kv8.model.loader import read_model_config
    from kv8.model.sources import resolve_model_path

    try:
        kind, path = resolve_model_path(args.model)
        config = args.create_engine_config(read_model_config(kind, path), kind, path)
        set_threads(config)
        num_blocks = tp.share("num_blocks")
        shard = load_shard(config, layout_for(config), num_blocks, tp)
    except BaseException as e:
        tp.set_ready(error=f"{type(e).__name__}: {e}")
        raise
    tp.set_ready()
    tp.connect(slot_bytes=allreduce_slot_bytes(config))
    while (inputs := tp.receive()) is not None:
        shard.runner.worker_step(inputs)


def worker_main(rank: int, size: int, port: int) -> None:
    """A rank kv8 started (:class:`kv8.distributed.launcher.RankProcess`): join rank 0's store on
    127.0.0.1:``port``, read the engine options rank 0 put there and run :func:`run_worker`."""
    from kv8.distributed.launcher import WORKER_ARGS_KEY

    logging.basicConfig(level=logging.WARNING)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=STORE_TIMEOUT)
    tp = TPGroup(rank, size, store=store, local=True)
    try:
        run_worker(tp, pickle.loads(store.get(WORKER_ARGS_KEY)))
    except Exception:
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> None:
    """``python -m kv8.distributed.worker --rank R --world-size N --port P`` (what rank 0 runs; not for users)."""
    parser = argparse.ArgumentParser(prog="python -m kv8.distributed.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    ns = parser.parse_args(argv)
    worker_main(ns.rank, ns.world_size, ns.port)


if __name__ == "__main__":
    main()
