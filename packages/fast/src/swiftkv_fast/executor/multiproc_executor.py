"""Tensor parallelism over N ranks: rank 0 is this process (the engine's), ranks 1..N-1 are worker
processes started with `torch.multiprocessing` (spawn) running worker/worker_process.py.

Start-up: rank 0 serves a TCPStore at `distributed_init_method` (default: a free port on 127.0.0.1),
spawns the workers, waits until each has joined (failing at once if one dies), then every rank builds
its process groups and its ModelRunner; the ranks agree on the number of KV blocks.

Each step rank 0 broadcasts the `StepInput` and every rank runs the model; rank 0 samples. A worker
that dies closes its connections, so rank 0's next collective fails within a second; a worker that
dies while no step runs is seen at once by a monitor thread (executor/worker_monitor.py), which calls
the callbacks given to `register_failure_callback` (the server's engine loop wakes up and turns
unhealthy). Either way the executor is then dead (`dead_error`), the other workers are stopped, and
every later step raises the same `WorkerDiedError`, which names the rank, its pid, its exit code and
the error it reported. An exception on
rank 0 inside the model also ends the executor: the workers are then blocked in a collective that
rank 0 will never join. (A Ctrl-C is held until the step ends: see engine/llm_engine.py.)

Shutdown (`shutdown()`, `del llm`, interpreter exit): the workers get None and exit; any still alive
after a few seconds are terminated, then killed. Workers are daemonic, and a worker whose rank 0
dies exits on its next collective: no process outlives the engine.
"""

from __future__ import annotations

import os
import signal
import time
import weakref

import torch
import torch.multiprocessing as mp

from swiftkv_fast.config import EngineConfig
from swiftkv_fast.distributed.parallel_state import (
    STORE_TIMEOUT,
    connect_store,
    free_init_method,
    init_tensor_parallel,
)
from swiftkv_fast.executor.executor import Executor, WorkerDiedError
from swiftkv_fast.executor.worker_monitor import start_worker_monitor
from swiftkv_fast.logger import init_logger
from swiftkv_fast.model.kv_cache_layout import KVCacheLayout
from swiftkv_fast.model.tp_sharding import TensorParallelShard, shard_state_dict
from swiftkv_fast.scheduler_output import SchedulerOutput
from swiftkv_fast.worker.model_runner import ModelRunner, ModelRunnerOutput
from swiftkv_fast.worker.worker_process import JOINED_KEY, WorkerSource, error_key, run_worker

logger = init_logger(__name__)

JOIN_POLL_S = 0.05
STOP_WAIT_S = 5.0
EXIT_WAIT_S = 2.0  # how long a failed collective waits for the worker that caused it to exit


class MultiprocExecutor(Executor):
    def __init__(
        self,
        config,
        econf: EngineConfig,
        layout: KVCacheLayout,
        state_dict: dict[str, torch.Tensor],
        checkpoint_dir: str | None,
    ):
        n = econf.tensor_parallel_size
        self.dead_error = None
        self.procs: list[mp.Process] = []
        self._groups: list = []  # [rank 0's TensorParallelGroup] once built (the finalizer stops via it)
        self._monitor: list = []  # [the worker monitor's stop connection] once started
        self._failure_callbacks: list = []
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self._groups, self._monitor)
        init_method = econf.distributed_init_method or free_init_method()
        self.store = connect_store(init_method, 0, n)
        # on CPU the ranks share the cores: each runs its model with 1/N of this process's threads
        num_threads = max(1, torch.get_num_threads() // n) if torch.device(econf.device).type == "cpu" else 0
        self.num_threads = num_threads
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, n):
                source = self._source(config, state_dict, checkpoint_dir, econf, rank)
                proc = ctx.Process(
                    target=run_worker,
                    args=(rank, n, init_method, econf, source, num_threads),
                    name=f"swiftkv-tp-rank{rank}",
                    daemon=True,
                )
                proc.start()
                self.procs.append(proc)
            self._wait_joined()
            tp = init_tensor_parallel(self.store, 0, n, torch.device(econf.device))
            self._groups.append(tp)
            shard = TensorParallelShard.of(config, 0, n)
            self.runner = ModelRunner(config, econf, layout, shard_state_dict(config, state_dict, shard), tp)
        except (KeyboardInterrupt, ValueError, TypeError):  # the same refusal on every rank, or Ctrl-C
            self.shutdown()
            raise
        except BaseException as e:
            raise self._failure("at start-up", e) from e
        this = weakref.ref(self)  # the monitor must not keep the executor alive (its finalizer stops it)
        self._monitor.append(
            start_worker_monitor(self.procs, lambda dead: (e := this()) and e._worker_died(dead))
        )
        logger.info(
            "tensor parallel: %d ranks (%s), worker pids %s, %d torch thread(s) per rank on CPU, init %s",
            n,
            "nccl" if torch.device(econf.device).type == "cuda" else "gloo",
            [p.pid for p in self.procs],
            num_threads,
            init_method,
        )

    @staticmethod
    def _source(config, state_dict, checkpoint_dir, econf: EngineConfig, rank: int) -> WorkerSource:
        if checkpoint_dir is not None:
            return WorkerSource(checkpoint_dir, econf.num_key_value_layers, econf.key_value_group_size)
        shard = TensorParallelShard.of(config, rank, econf.tensor_parallel_size)
        return WorkerSource(config=config, shard_state_dict=shard_state_dict(config, state_dict, shard))

    def _wait_joined(self) -> None:
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while self.store.add(JOINED_KEY, 0) < len(self.procs):
            self._raise_if_a_worker_died("at start-up")
            if time.monotonic() > deadline:
                raise WorkerDiedError(
                    f"tensor-parallel workers did not join within {STORE_TIMEOUT.total_seconds():.0f} s"
                )
            time.sleep(JOIN_POLL_S)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.dead_error is not None:
            raise WorkerDiedError(str(self.dead_error))
        self._raise_if_a_worker_died("between steps")
        step = self.runner.prepare_step(out)
        threads = torch.get_num_threads()
        try:
            if self.num_threads:  # rank 0's share of the cores while it runs the model
                torch.set_num_threads(self.num_threads)
            self.runner.tp.broadcast_object(step)
            logits = self.runner.execute_model(step)
        except BaseException as e:
            raise self._failure("during a step", e) from e
        finally:
            torch.set_num_threads(threads)
        return self.runner.sample(out, logits)

    def register_failure_callback(self, callback) -> None:
        """`callback()` is called (on the monitor thread) once a worker has died unasked."""
        self._failure_callbacks.append(callback)

    def _worker_died(self, dead: list) -> None:
        """On the monitor thread: the workers `dead` exited unasked. The executor is dead from now on (a
        step that meets the death reports it too); the other workers are stopped and the callbacks told."""
        if self.dead_error is None:
            for p in dead:  # its sentinel closes as it exits, a moment before its exit code is there
                p.join(EXIT_WAIT_S)
            parts = "; ".join(self._describe(rank, p) for rank, p in enumerate(self.procs, 1) if p in dead)
            self.dead_error = WorkerDiedError(
                f"tensor-parallel engine stopped: {parts}. Create a new engine."
            )
            logger.error("%s", self.dead_error)
        self.shutdown()
        for callback in self._failure_callbacks:
            callback()

    def _raise_if_a_worker_died(self, when: str) -> None:
        if any(p.exitcode is not None for p in self.procs):
            raise self._failure(when, None)

    def _failure(self, when: str, cause: BaseException | None) -> WorkerDiedError:
        """The executor is dead from now on: stop the workers; the error says which rank died and why."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while time.monotonic() < deadline and all(p.exitcode is None for p in self.procs):
            time.sleep(JOIN_POLL_S)
        dead = [(rank, p) for rank, p in enumerate(self.procs, 1) if p.exitcode is not None]
        if dead:
            parts = [self._describe(rank, p) for rank, p in dead]
            message = f"{when}: " + "; ".join(parts)
        else:
            message = (
                f"{when}: rank 0 failed ({type(cause).__name__}: {cause}), so the tensor-parallel ranks "
                "are out of step"
            )
        self.dead_error = WorkerDiedError(f"tensor-parallel engine stopped {message}. Create a new engine.")
        logger.error("%s", self.dead_error)
        self.shutdown()
        return self.dead_error

    def _describe(self, rank: int, proc) -> str:
        code = proc.exitcode
        if code is None:  # not reaped yet
            how = "exited"
        else:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        text = f"worker rank {rank} (pid {proc.pid}) died ({how})"
        try:
            if self.store.check([error_key(rank)]):
                reported = self.store.get(error_key(rank)).decode(errors="replace").strip()
                text += f", reporting: {reported.splitlines()[-1]}"
        except Exception:  # the store is unusable: the exit code is all there is
            pass
        return text

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        if self.dead_error is not None:
            self._groups.clear()  # out of step: no broadcast, terminate
        else:
            self.dead_error = WorkerDiedError("the tensor-parallel engine was shut down")
        self._finalizer()


def _stop_workers(procs: list, groups: list, monitor: list) -> None:
    """Stop watching the workers, ask them to exit (None), then terminate and kill what is left. Never
    raises."""
    for stop in monitor:
        stop.close()
    monitor.clear()
    alive = [p for p in procs if p.exitcode is None]
    if groups and alive and len(alive) == len(procs):
        try:
            groups[0].broadcast_object(None)
        except Exception:  # a worker is gone or out of step: terminate below
            pass
    deadline = time.monotonic() + STOP_WAIT_S
    for p in alive:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.terminate()
            p.join(timeout=EXIT_WAIT_S)
        if p.exitcode is None:
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    groups.clear()
