"""The custom op that writes one AcrossKV group's K/V into its cache, visible to the compiler.

vLLM's own `unified_kv_cache_update` returns a dummy tensor that only the layer's attention call
consumes; a SwiftKV cache owner never attends, so nothing would read that dummy and Inductor's
dead-code elimination would drop the write without any error (all-zero caches, wrong tokens). This op
returns nothing and is declared side-effecting, so it is kept in every compiled graph, in program
order with the attention calls that read the cache.
"""

from __future__ import annotations

import torch
from torch.library import Library
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update
from vllm.utils.torch_utils import direct_register_custom_op

_LIBRARY = Library("swiftkv_vllm", "FRAGMENT")  # the op lives as long as this module


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> None:
    """key, value: (num_tokens, num_kv_heads, head_dim), written at the slots vLLM scheduled for
    the tokens of this step in the cache of attention layer `layer_name`."""
    unified_kv_cache_update(key, value, layer_name)


def _write_kv_cache_fake(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> None:
    return None


direct_register_custom_op(
    op_name="write_kv_cache",
    op_func=write_kv_cache,
    mutates_args=[],
    fake_impl=_write_kv_cache_fake,
    target_lib=_LIBRARY,
)
torch.fx.node.has_side_effect(torch.ops.swiftkv_vllm.write_kv_cache.default)
