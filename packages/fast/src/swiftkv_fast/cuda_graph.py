"""CUDA graphs for SwiftKV's second half (layers >= L, the final norm and lm_head).

In the second half every request has exactly one query token, so a step is a
decode-shaped batch whatever mix of prefill and decode it came from. Its
shapes depend only on the batch size and the block-table width, so one graph
per batch-size bucket serves every step.

Contract for the model runner
-----------------------------
``second_half(hidden, positions, seq_lens, block_tables) -> logits``
    hidden: (B, hidden_size) in ``dtype`` (the residual stream after layer L-1;
    the model adds residuals in place, so there is no separate residual);
    positions: (B,) int64; seq_lens: (B,) int32 (context length, query at
    ``seq_lens[i] - 1``); block_tables: a tuple with one (B, max_blocks) int32
    table per kvcache group (full attention, sliding window, ...). Returns
    (B, vocab) logits. It must be capturable: no host syncs (``.item()``,
    ``.tolist()``, data-dependent shapes), no allocation that outlives the call
    except its output, and K/V must already be written to the cache (write_kv
    runs before, eagerly, for every scheduled token). It must tolerate padding
    rows: ``seq_lens == 0``, block tables all 0 (the null block), position
    ``pad_position``, hidden zeros; their outputs are dropped (the Triton
    decode kernel returns zeros for them). Rows must not interact (row-wise
    ops only), so padding never changes a real row.

``SecondHalfGraphRunner.run(...)`` takes the same arguments for ``n`` real
rows (block tables at most ``max_blocks`` wide) and returns ``(n, vocab)``
logits. On a graph replay these are a view into ONE fp32 ``(max_batch, vocab)``
buffer that every bucket's graph copies its logits into (as the last op of the
capture), valid until the next ``run``: sample from them (or clone) before the
next step. The graphs' own outputs are not kept, so their pool memory is shared
by every capture: one logits buffer in all, not one per bucket (at 256 sequences
and a 128k vocabulary, 0.13 GB instead of 1.2 GB).
A step falls back to eager ``second_half`` on the given tensors when the runner
is disabled (``enforce_eager``, CPU), not captured yet, ``n`` exceeds the
largest bucket, or a block table is wider than captured.

``emulate=True`` replaces capture and replay by direct calls of
``second_half`` on the padded static buffers (any device): the bucketing,
padding and unpadding are then exercised without CUDA (tests).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence

import torch

SecondHalfFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, ending with the first
    bucket >= ``max_num_seqs``."""
    if int(max_num_seqs) < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes: list[int] = []
    s = 1
    while True:
        sizes.append(s)
        if s >= max_num_seqs:
            return sizes
        s = s * 2 if s < 8 else s + (8 if s < 64 else 16)


def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket >= n (``sizes`` ascending), or None when n is larger than every bucket."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class SecondHalfGraphRunner:
    """One CUDA graph of ``second_half`` per batch-size bucket, sharing a memory pool.

    Args:
        second_half: the callable described in the module docstring.
        max_num_seqs: the engine's limit; buckets from :func:`capture_sizes` unless ``sizes`` is given.
        max_blocks_per_req: width of the static block tables (``cdiv(max_model_len, block_size)``).
        num_groups: block tables per step (kvcache groups).
        hidden_size, dtype, device: of the hidden buffer.
        enabled: False (``enforce_eager=True``) makes every ``run`` eager. A non-CUDA device without
            ``emulate`` is also always eager.
        emulate: capture = nothing, replay = a direct call on the padded static buffers.
        num_warmup: eager calls per bucket before its capture (lazy inits, Triton compilation).
        pad_position: position written into padding rows.
    """

    def __init__(
        self,
        second_half: SecondHalfFn,
        *,
        max_num_seqs: int,
        max_blocks_per_req: int,
        num_groups: int = 1,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        sizes: Sequence[int] | None = None,
        enabled: bool = True,
        emulate: bool = False,
        num_warmup: int = 2,
        pad_position: int = 0,
    ):
        self.second_half = second_half
        self.device = torch.device(device)
        self.sizes = sorted(set(sizes)) if sizes is not None else capture_sizes(max_num_seqs)
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"bad capture sizes {self.sizes}")
        self.emulate = emulate
        self.enabled = bool(enabled) and (emulate or self.device.type == "cuda")
        self.max_batch = self.sizes[-1]
        self.max_blocks = int(max_blocks_per_req)
        self.num_groups = int(num_groups)
        if self.num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.hidden_size = int(hidden_size)
        self.num_warmup = int(num_warmup)
        self.pad_position = int(pad_position)
        self.stats = {"graph": 0, "eager": 0}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # (max_batch, vocab) fp32, made at capture
        self._captured = False
        self._pool = None
        self.capture_seconds: float | None = None
        if self.enabled:
            b, dev = self.max_batch, self.device
            self.hidden = torch.zeros(b, self.hidden_size, dtype=dtype, device=dev)
            self.positions = torch.full((b,), self.pad_position, dtype=torch.int64, device=dev)
            self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
            self.block_tables = tuple(
                torch.zeros(b, self.max_blocks, dtype=torch.int32, device=dev) for _ in range(self.num_groups)
            )

    @property
    def captured(self) -> bool:
        return self._captured

    def _static_args(self, bs: int) -> tuple[torch.Tensor, ...]:
        return (
            self.hidden[:bs],
            self.positions[:bs],
            self.seq_lens[:bs],
            tuple(bt[:bs] for bt in self.block_tables),
        )

    @torch.no_grad()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one shared memory pool."""
        if not self.enabled or self._captured:
            return
        start = time.perf_counter()
        if self.emulate:
            for bs in reversed(self.sizes):
                for _ in range(max(1, self.num_warmup)):
                    self._logits_buffer(self.second_half(*self._static_args(bs)))
            self._captured = True
            self.capture_seconds = time.perf_counter() - start
            return
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        for bs in reversed(self.sizes):
            args = self._static_args(bs)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up off the default stream, as capture does
                for _ in range(max(1, self.num_warmup)):
                    logits = self._logits_buffer(self.second_half(*args))
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits[:bs].copy_(self.second_half(*args))
            self._graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self._captured = True
        self.capture_seconds = time.perf_counter() - start

    def _logits_buffer(self, out: torch.Tensor) -> torch.Tensor:
        """The shared fp32 (max_batch, vocab) logits buffer, made on first use from an output's shape."""
        if self.logits is None:
            self.logits = torch.zeros(self.max_batch, out.shape[-1], dtype=torch.float32, device=out.device)
        return self.logits

    def bucket(self, n: int, block_table_width: int) -> int | None:
        """The bucket a step of n rows replays, or None for eager."""
        if not (self.enabled and self._captured) or block_table_width > self.max_blocks:
            return None
        return bucket_for(n, self.sizes)

    @torch.no_grad()
    def run(self, hidden, positions, seq_lens, block_tables: Sequence[torch.Tensor]) -> torch.Tensor:
        n = hidden.shape[0]
        block_tables = tuple(block_tables)
        if self.enabled and hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden size {hidden.shape[-1]} != captured {self.hidden_size}")
        if self.enabled and len(block_tables) != self.num_groups:
            raise ValueError(f"{len(block_tables)} block tables, captured with {self.num_groups}")
        width = max(bt.shape[1] for bt in block_tables)
        bs = self.bucket(n, width) if n > 0 else None
        if bs is None:
            self.stats["eager"] += 1
            return self.second_half(hidden, positions, seq_lens, block_tables)
        self.hidden[:n].copy_(hidden)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(seq_lens)
        for static, bt in zip(self.block_tables, block_tables):
            w = bt.shape[1]
            static[:n, :w].copy_(bt)
            if w < self.max_blocks:
                static[:n, w:].zero_()
        if bs > n:  # padding rows
            self.hidden[n:bs].zero_()
            self.positions[n:bs].fill_(self.pad_position)
            self.seq_lens[n:bs].zero_()
            for static in self.block_tables:
                static[n:bs].zero_()
        self.stats["graph"] += 1
        if self.emulate:
            self.logits[:bs].copy_(self.second_half(*self._static_args(bs)))
        else:
            self._graphs[bs].replay()
        return self.logits[:n]
