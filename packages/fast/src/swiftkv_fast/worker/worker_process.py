"""The process of one tensor-parallel worker (ranks 1..N-1; rank 0 is the engine's process).

It joins rank 0's store, builds its ModelRunner over its shard (read from the checkpoint directory, or
sent by rank 0), then runs every step rank 0 broadcasts until it receives None. It ignores SIGINT: a
Ctrl-C reaches the whole process group, and the engine (rank 0) decides what it means. Any error is
written to the store under ``tp/error/RANK`` (rank 0 puts it in its own error message) and ends the
process; so does rank 0's death, which closes the connections the worker waits on.
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from dataclasses import dataclass

import torch

from swiftkv_fast.config import EngineConfig
from swiftkv_fast.distributed.parallel_state import connect_store, init_tensor_parallel
from swiftkv_fast.logger import init_logger
from swiftkv_fast.model.kv_cache_layout import KVCacheLayout
from swiftkv_fast.model.loader import load_checkpoint
from swiftkv_fast.model.tp_sharding import TensorParallelShard, shard_state_dict
from swiftkv_fast.worker.model_runner import ModelRunner

logger = init_logger(__name__)

JOINED_KEY = "tp/joined"


def error_key(rank: int) -> str:
    return f"tp/error/{rank}"


@dataclass
class WorkerSource:
    """Where a worker gets its weights: the checkpoint directory (None with no state_dict: the embedded
    model), or the config and its shard sent by rank 0."""

    checkpoint_dir: str | None = None
    num_key_value_layers: int | None = None
    key_value_group_size: int | None = None
    config: object = None
    shard_state_dict: dict[str, torch.Tensor] | None = None

    def load(self, rank: int, size: int):
        """-> (config, the rank's shard of the state dict)."""
        if self.shard_state_dict is not None:
            return self.config, self.shard_state_dict
        config, state_dict, _ = load_checkpoint(
            self.checkpoint_dir, self.num_key_value_layers, self.key_value_group_size
        )
        return config, shard_state_dict(config, state_dict, TensorParallelShard.of(config, rank, size))


def run_worker(
    rank: int, size: int, init_method: str, econf: EngineConfig, source: WorkerSource, num_threads: int
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fmt = f"%(levelname)s %(asctime)s rank{rank} %(name)s] %(message)s"
    for handler in logging.getLogger("swiftkv_fast").handlers:  # its lines say which rank wrote them
        handler.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
    if num_threads:  # on CPU the ranks share the cores; 0 on CUDA: torch's default
        torch.set_num_threads(num_threads)
    store = connect_store(init_method, rank, size)
    try:
        store.add(JOINED_KEY, 1)
        device = torch.device(econf.device)
        if device.type == "cuda":  # rank r runs on cuda:r ("cuda" is the current device)
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        tp = init_tensor_parallel(store, rank, size, device)
        config, state_dict = source.load(rank, size)
        shard = TensorParallelShard.of(config, rank, size)
        layout = KVCacheLayout.from_config(config, econf.block_size, econf.kv_cache_dtype, shard.num_kv_heads)
        runner = ModelRunner(config, econf, layout, state_dict, tp)
        del state_dict
        while (step := tp.broadcast_object(idle=True)) is not None:
            runner.execute_model(step)
    except BaseException as e:
        try:
            store.set(error_key(rank), traceback.format_exc())
        except Exception:  # rank 0 (the store's server) is gone
            pass
        logger.error("tensor-parallel worker rank %d stops: %s", rank, f"{type(e).__name__}: {e}")
        sys.exit(1)
