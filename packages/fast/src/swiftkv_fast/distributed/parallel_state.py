"""The tensor-parallel group of one engine: its rank, its size and the torch.distributed process groups
its collectives run on.

Two groups, as vLLM has them: `device_group` carries the model's collectives (the all-reduce after each
row-parallel layer, the vocab all-gather of the logits; NCCL on CUDA, gloo on CPU) and `cpu_group`
(gloo) carries each step's input from rank 0 to the workers. The groups are built from a `TCPStore` at
an explicit ``tcp://host:port`` without `init_process_group`, so one process can hold several engines
(each its own store and groups) and rank 0 stays the user's process.

Worked example, N = 2 on CPU: rank 0 (the engine) creates the store at tcp://127.0.0.1:P as its master;
worker rank 1 connects to it; both build their gloo groups from it under the prefix "tp/"; each step
rank 0 calls `broadcast_object(step)` and rank 1 `broadcast_object()` returns that step.
"""

from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

# the model's collectives: a peer that takes longer than this inside a step is taken for hung
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# a worker waits this long for the next step (an idle server): a dead rank 0 is noticed at once anyway
# (its connections close), so this only bounds a rank 0 that hangs without exiting
IDLE_TIMEOUT = timedelta(days=7)
STORE_TIMEOUT = timedelta(minutes=2)


def free_init_method(host: str = "127.0.0.1") -> str:
    """A tcp:// address on a port that is free now (rank 0 binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def parse_init_method(init_method: str) -> tuple[str, int]:
    """'tcp://host:port' -> (host, port); ValueError naming the field otherwise."""
    url = urlparse(init_method)
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "tcp" or not url.hostname or port is None:
        raise ValueError(f"distributed_init_method must be 'tcp://HOST:PORT', got {init_method!r}")
    return url.hostname, port


@dataclass
class TensorParallelGroup:
    rank: int
    size: int
    device_group: Any = None  # a c10d backend (ProcessGroupNCCL / ProcessGroupGloo); None when size == 1
    cpu_group: Any = None  # ProcessGroupGloo; None when size == 1
    store: Any = None  # the TCPStore the groups were built from (rank 0 is its server)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (the output of a row-parallel layer). x: any shape."""
        if self.size > 1:
            self.device_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(S, V / N) on every rank -> (S, V): the ranks' column blocks side by side (vocab-parallel
        logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None, idle: bool = False) -> Any:
        """Rank 0's `obj`, pickled, on every rank (a step's input, or None to stop the workers).
        `idle`: a worker waiting for the next step waits up to IDLE_TIMEOUT, not COLLECTIVE_TIMEOUT."""
        if self.size == 1:
            return obj
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.cpu_group.broadcast(size, 0, IDLE_TIMEOUT if idle else None).wait()
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        self.cpu_group.broadcast(data, 0).wait()
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. the KV blocks every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.cpu_group.allreduce([t], opts).wait()
        return int(t)


SINGLE = TensorParallelGroup(rank=0, size=1)


def connect_store(init_method: str, rank: int, size: int) -> dist.TCPStore:
    """Rank 0 serves the store (without waiting for the others); the others connect to it."""
    host, port = parse_init_method(init_method)
    return dist.TCPStore(host, port, size, is_master=rank == 0, timeout=STORE_TIMEOUT, wait_for_workers=False)


def init_tensor_parallel(
    store: dist.TCPStore, rank: int, size: int, device: torch.device
) -> TensorParallelGroup:
    """Both groups of `rank` from the store; blocks until every rank has joined."""
    if size == 1:
        return SINGLE
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("tp/cpu/", store), rank, size, COLLECTIVE_TIMEOUT)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        device_group = dist.ProcessGroupNCCL(dist.PrefixStore("tp/nccl/", store), rank, size, opts)
    else:
        device_group = dist.ProcessGroupGloo(
            dist.PrefixStore("tp/dev/", store), rank, size, COLLECTIVE_TIMEOUT
        )
    return TensorParallelGroup(rank, size, device_group, cpu, store)
