"""CUDA graphs for SwiftKV's second half (layers >= L, the final norm and lm_head): lazy capture per
batch-size bucket, replay, eager fallback, counters.

In the second half every request has exactly one query token, so a step is decode-shaped whatever mix
it came from, and its shapes depend only on the batch size and the block-table width: one graph per
batch-size bucket serves every step with sampled tokens (also at L == N, where the tail is the final
norm and lm_head). `graphs_disabled_reason`, decided once at construction, says why graphs are off:
``enforce_eager``, a non-CUDA device, or a backend that cannot be captured
(``backend.supports_cuda_graph``: the torch backend's decode syncs with the host). Capture happens at
the first ``run`` and is logged; a failed capture is logged and the second half stays eager.

Contract of ``second_half(hidden, positions, seq_lens, block_tables) -> (B, vocab) logits``: hidden (B,
hidden_size) in ``dtype`` (the residual stream after layer L-1, fp32 in the engine whatever the weights'
dtype; residuals are added in place), positions (B,) int64, seq_lens (B,) int32 (query at
``seq_lens[i]-1``), one (B, max_blocks) int32 block table per kvcache group. It must be capturable: no
host syncs (``.item()``, ``.tolist()``, data-dependent shapes), no allocation that outlives the call but
its output, and the K/V already written to the cache (first_half writes every scheduled token's).
Padding rows (``seq_lens == 0``, null-block tables, position ``pad_position``, zero hidden) must be
tolerated, and rows must not interact, so padding never changes a real row.

``run(...)`` returns ``(n, vocab)`` logits for ``n`` real rows. On replay they are a view into ONE
fp32 ``(max_batch, vocab)`` buffer that every bucket's graph copies into last, valid until the next
``run``: sample from them (or clone) first. Keeping no graph's own output lets every capture share one
pool (at 256 sequences and a 128k vocabulary: 0.13 GB instead of 1.2 GB). A step runs eagerly when
graphs are disabled, ``n`` exceeds the largest bucket, or a block table is wider than captured.

``emulate=True`` replaces capture and replay by direct calls on the padded static buffers (any
device), so the bucketing, padding and unpadding are tested without CUDA.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence

import torch

from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

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


def graphs_disabled_reason(
    device: torch.device, enforce_eager: bool, backend, emulate: bool = False
) -> str | None:
    """Why the second half runs eagerly, or None when CUDA graphs are used. ``backend`` None: the
    caller's ``second_half`` is capturable. ``emulate`` needs no CUDA and no capturable backend."""
    if enforce_eager:
        return "enforce_eager=True"
    if emulate:
        return None
    if device.type != "cuda":
        return f"device {device.type} (CUDA graphs need CUDA)"
    if backend is not None and not backend.supports_cuda_graph:
        return f"attention backend {backend.name!r} cannot be captured (use 'triton' or 'flash_attn')"
    return None


class SecondHalfGraphs:
    """One CUDA graph of ``second_half`` per batch-size bucket, sharing a memory pool.

    Args:
        second_half: the callable described in the module docstring.
        max_num_seqs: the engine's limit; buckets from :func:`capture_sizes` unless ``sizes`` is given.
        max_blocks_per_req: width of the static block tables (``cdiv(max_model_len, block_size)``).
        num_groups: block tables per step (kvcache groups).
        hidden_size, dtype, device: of the hidden buffer.
        enforce_eager, backend, emulate: see :func:`graphs_disabled_reason`.
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
        enforce_eager: bool = False,
        backend=None,
        emulate: bool = False,
        sizes: Sequence[int] | None = None,
        num_warmup: int = 2,
        pad_position: int = 0,
    ):
        self.second_half = second_half
        self.device = torch.device(device)
        self.sizes = sorted(set(sizes)) if sizes is not None else capture_sizes(max_num_seqs)
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"bad capture sizes {self.sizes}")
        self.num_groups = int(num_groups)
        if self.num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.emulate = emulate
        self.max_batch = self.sizes[-1]
        self.max_blocks = int(max_blocks_per_req)
        self.hidden_size = int(hidden_size)
        self.num_warmup = int(num_warmup)
        self.pad_position = int(pad_position)
        self.counts = {"graph": 0, "eager": 0}  # second-half steps replayed / run eagerly
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # (max_batch, vocab) fp32, made at capture
        self.captured = False
        self.capture_seconds: float | None = None
        self.disabled_reason = graphs_disabled_reason(self.device, enforce_eager, backend, emulate)
        if self.disabled_reason is not None:
            logger.info("second half: eager (%s)", self.disabled_reason)
            return
        b, dev = self.max_batch, self.device
        self.hidden = torch.zeros(b, self.hidden_size, dtype=dtype, device=dev)
        self.positions = torch.full((b,), self.pad_position, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.block_tables = tuple(
            torch.zeros(b, self.max_blocks, dtype=torch.int32, device=dev) for _ in range(self.num_groups)
        )

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    def stats(self) -> dict[str, int | float | bool | None]:
        return {
            "cuda_graph_enabled": self.enabled,
            "cuda_graph_replays": self.counts["graph"],
            "eager_second_half_steps": self.counts["eager"],
            "cuda_graph_capture_s": self.capture_seconds,
        }

    def capture(self) -> None:
        """Capture every bucket once (a no-op when disabled or done); a failure disables the graphs."""
        if not self.enabled or self.captured:
            return
        logger.info(
            "second half: capturing CUDA graphs for batch sizes %s (block tables of %d blocks, "
            "%d group(s))%s",
            self.sizes,
            self.max_blocks,
            self.num_groups,
            " [emulated]" if self.emulate else "",
        )
        try:
            self._capture_graphs()
        except Exception as e:  # keep serving, eagerly; get_stats() shows cuda_graph_enabled=False
            self.disabled_reason = f"capture failed: {type(e).__name__}: {e}"
            logger.exception("second half: CUDA graph capture failed, running eagerly from now on")
            return
        logger.info("second half: %d CUDA graphs captured in %.2f s", len(self.sizes), self.capture_seconds)

    def _static_args(self, bs: int) -> tuple[torch.Tensor, ...]:
        return (
            self.hidden[:bs],
            self.positions[:bs],
            self.seq_lens[:bs],
            tuple(bt[:bs] for bt in self.block_tables),
        )

    @torch.no_grad()
    def _capture_graphs(self) -> None:
        """Warm up and capture every bucket, largest first, into one shared memory pool."""
        start = time.perf_counter()
        if self.emulate:
            for bs in reversed(self.sizes):
                for _ in range(max(1, self.num_warmup)):
                    self._logits_buffer(self.second_half(*self._static_args(bs)))
            self.captured = True
            self.capture_seconds = time.perf_counter() - start
            return
        pool = torch.cuda.graph_pool_handle()
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
            with torch.cuda.graph(graph, pool=pool):
                logits[:bs].copy_(self.second_half(*args))
            self._graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.captured = True
        self.capture_seconds = time.perf_counter() - start

    def _logits_buffer(self, out: torch.Tensor) -> torch.Tensor:
        """The shared fp32 (max_batch, vocab) logits buffer, made on first use from an output's shape."""
        if self.logits is None:
            self.logits = torch.zeros(self.max_batch, out.shape[-1], dtype=torch.float32, device=out.device)
        return self.logits

    def _bucket(self, n: int, block_table_width: int) -> int | None:
        """The bucket a step of n rows replays, or None for eager: the one per-step decision."""
        if n < 1 or not (self.enabled and self.captured) or block_table_width > self.max_blocks:
            return None
        return bucket_for(n, self.sizes)

    @torch.no_grad()
    def run(self, hidden, positions, seq_lens, block_tables: Sequence[torch.Tensor]) -> torch.Tensor:
        """Logits (n, vocab); a view into the shared logits buffer on a replay, valid until the next run."""
        self.capture()
        n = hidden.shape[0]
        block_tables = tuple(block_tables)
        if self.enabled and hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden size {hidden.shape[-1]} != captured {self.hidden_size}")
        if self.enabled and len(block_tables) != self.num_groups:
            raise ValueError(f"{len(block_tables)} block tables, captured with {self.num_groups}")
        bs = self._bucket(n, max(bt.shape[1] for bt in block_tables))
        if bs is None:
            self.counts["eager"] += 1
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
        self.counts["graph"] += 1
        if self.emulate:
            self.logits[:bs].copy_(self.second_half(*self._static_args(bs)))
        else:
            self._graphs[bs].replay()
        return self.logits[:n]
