"""Executors (vLLM's name): what runs the model for the engine. `Executor` is one rank in this process;
`MultiprocExecutor` (executor/multiproc_executor.py) adds tensor-parallel worker processes.

The engine talks to either the same way: `execute(scheduler_output)` -> ModelRunnerOutput,
`dead_error` (None while it can run steps), `register_failure_callback(callback)` (called when a
worker dies, even between steps), `shutdown()`; `runner` is rank 0's ModelRunner."""

from __future__ import annotations

import torch

from swiftkv_fast.config import EngineConfig
from swiftkv_fast.model.kv_cache_layout import KVCacheLayout
from swiftkv_fast.scheduler_output import SchedulerOutput
from swiftkv_fast.worker.model_runner import ModelRunner, ModelRunnerOutput


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank died or the ranks fell out of step: the engine cannot run another step."""


class Executor:
    """tensor_parallel_size == 1: the ModelRunner in this process."""

    dead_error: WorkerDiedError | None = None

    def __init__(
        self, config, econf: EngineConfig, layout: KVCacheLayout, state_dict: dict[str, torch.Tensor]
    ):
        self.runner = ModelRunner(config, econf, layout, state_dict)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)

    def register_failure_callback(self, callback) -> None:
        """One rank in this process: no worker can die apart from it."""

    def shutdown(self) -> None:
        pass


def make_executor(
    config,
    econf: EngineConfig,
    layout: KVCacheLayout,
    state_dict: dict[str, torch.Tensor],
    checkpoint_dir: str | None = None,
) -> Executor:
    """`checkpoint_dir`: where tensor-parallel workers read their weights (None: rank 0 sends each
    worker its shard of `state_dict`)."""
    if econf.tensor_parallel_size == 1:
        return Executor(config, econf, layout, state_dict)
    from swiftkv_fast.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, econf, layout, state_dict, checkpoint_dir)
