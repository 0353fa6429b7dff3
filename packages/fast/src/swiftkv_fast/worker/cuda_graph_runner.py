"""The model runner's second half behind CUDA graphs: when graphs are used, lazy capture, counters.

The second half (layers >= L, final norm, lm_head) sees one query per request, so every step is a
decode-shaped batch that a graph captured per batch-size bucket can replay (swiftkv_fast.cuda_graph).
Graphs are used for every step with sampled tokens, also when L == N (the tail is then the final
norm and lm_head), provided that:
  - the device is CUDA (on CPU the second half is always eager),
  - ``enforce_eager`` is False,
  - the attention backend can be captured (``backend.supports_cuda_graph``: triton, flash_attn;
    not torch, whose decode syncs with the host).
The K/V of the second-half layers is written eagerly for every scheduled token before (first_half).
Capture happens at the first step that has sampled tokens, and is logged with its duration.
"""

from __future__ import annotations

import torch

from swiftkv_fast.cuda_graph import SecondHalfGraphRunner
from swiftkv_fast.logger import init_logger
from swiftkv_fast.model.swiftkv_model import SwiftKVModel

logger = init_logger(__name__)


def graphs_disabled_reason(device: torch.device, enforce_eager: bool, backend) -> str | None:
    """Why the second half runs eagerly on this engine, or None when CUDA graphs are used."""
    if enforce_eager:
        return "enforce_eager=True"
    if device.type != "cuda":
        return f"device {device.type} (CUDA graphs need CUDA)"
    if not getattr(backend, "supports_cuda_graph", False):
        return f"attention backend {backend.name!r} cannot be captured (use 'triton' or 'flash_attn')"
    return None


class SecondHalfGraphs:
    """``run(h, positions, seq_lens, block_tables)`` -> fp32 logits of the second half, replayed from a
    CUDA graph when possible. ``emulate=True`` (tests, any device) replays by direct calls on the
    padded static buffers: bucketing and padding go through the real model without CUDA."""

    def __init__(
        self,
        model: SwiftKVModel,
        kv_cache: torch.Tensor,
        *,
        max_num_seqs: int,
        max_blocks_per_req: int,
        num_groups: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        enforce_eager: bool,
        emulate: bool = False,
        sizes: list[int] | None = None,
    ):
        self.disabled_reason = "enforce_eager=True" if enforce_eager else None
        if not emulate and self.disabled_reason is None:
            self.disabled_reason = graphs_disabled_reason(device, enforce_eager, model.backend)

        def second_half(hidden, positions, seq_lens, block_tables):
            return model.second_half(hidden, positions, seq_lens, block_tables, kv_cache)

        self.runner = SecondHalfGraphRunner(
            second_half,
            max_num_seqs=max_num_seqs,
            max_blocks_per_req=max_blocks_per_req,
            num_groups=num_groups,
            hidden_size=hidden_size,
            dtype=dtype,
            device=device,
            sizes=sizes,
            enabled=self.disabled_reason is None,
            emulate=emulate,
        )
        if self.disabled_reason is not None:
            logger.info("second half: eager (%s)", self.disabled_reason)

    @property
    def enabled(self) -> bool:
        return self.runner.enabled

    def capture(self) -> None:
        if not self.runner.enabled or self.runner.captured:
            return
        r = self.runner
        logger.info(
            "second half: capturing CUDA graphs for batch sizes %s (block tables of %d blocks, "
            "%d group(s))%s",
            r.sizes,
            r.max_blocks,
            r.num_groups,
            " [emulated]" if r.emulate else "",
        )
        try:
            r.capture()
        except Exception as e:  # keep serving, eagerly; get_stats() shows cuda_graph_enabled=False
            r.enabled = False
            self.disabled_reason = f"capture failed: {type(e).__name__}: {e}"
            logger.exception("second half: CUDA graph capture failed, running eagerly from now on")
            return
        logger.info("second half: %d CUDA graphs captured in %.2f s", len(r.sizes), r.capture_seconds)

    def run(self, h, positions, seq_lens, block_tables) -> torch.Tensor:
        """Logits (S, vocab); a view into a graph's output buffer on a replay, valid until the next run."""
        self.capture()
        return self.runner.run(h, positions, seq_lens, block_tables)

    def stats(self) -> dict[str, int | float | bool | None]:
        return {
            "cuda_graph_enabled": self.runner.enabled,
            "cuda_graph_replays": self.runner.stats["graph"],
            "eager_second_half_steps": self.runner.stats["eager"],
            "cuda_graph_capture_s": self.runner.capture_seconds,
        }
