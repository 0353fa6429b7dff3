"""A run of decoder layers over decode-shaped rows (one token per request) on CPU in fp32 as one C call
(csrc/decode_stack.c).

Why: a decode step's layers as separate kernels are ~200 wrapped calls, each some tens of us of Python,
ctypes and a fresh output tensor while the OpenMP threads wait. Here the same kernels (the panel GEMM
with the ops packed in front of it, RoPE and the KV write, decode attention) run inside one OpenMP
region, the ops separated by barriers, with their buffers allocated once per call. Every op is the same
code on the same rows in the same order, so the result is bit-identical to the separate kernels'
(tests/test_cpu_decode_stack.py).

Every layer's linears must be panel GEMM layouts (PanelWeight); model/decode_stack.py calls this only
where the kernel chooser runs the panel GEMM at the step's row count for every one of them. Inputs are
checked before any work (positions within the RoPE table, seq_lens within the block tables, the block
ids read, the slots written): a bad one raises ValueError with nothing written, h included. Built per
(head_dim, group, cache dtype) by kernels/build.py; `decode-stack` in SWIFTKV_DISABLED_KERNELS turns it
off (the model then runs the ops one by one).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from swiftkv_fast import envs
from swiftkv_fast.kernels import build, cpu_decode, cpu_gemm, native

KERNEL = "decode-stack"  # its name in SWIFTKV_DISABLED_KERNELS (envs.py)


# csrc/decode_stack.c's structures, field for field
class StackLinear(ctypes.Structure):
    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("N", ctypes.c_int64),
        ("K", ctypes.c_int64),
        ("format", ctypes.c_int64),
    ]


class StackLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", StackLinear),
        ("o", StackLinear),
        ("gate_up", StackLinear),
        ("down", StackLinear),
        ("kv_slot", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("writes_kv", ctypes.c_int64),
    ]


class StackGroup(ctypes.Structure):
    _fields_ = [
        ("seq_lens", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("bt_stride", ctypes.c_int64),
        ("max_blocks", ctypes.c_int64),
        ("slots", ctypes.c_void_p),
    ]


class StackStep(ctypes.Structure):
    _fields_ = [
        ("h", ctypes.c_void_p),
        ("T", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("positions", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("max_pos", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("kv_cache", ctypes.c_void_p),
        ("slot_stride", ctypes.c_int64),
        ("kv_stride", ctypes.c_int64),
        ("block_stride", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("bs", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("timings", ctypes.c_void_p),
    ]


# StackStep.timings' entries, in order (STACK_TIMED_*)
TIMED_PHASES = ("linear", "attention", "rope_kv")


def enabled() -> bool:
    return envs.kernel_enabled(KERNEL)


def kernel(head_dim: int, group: int, kv_dtype: torch.dtype = torch.float32) -> Callable | None:
    """The built stack for this (head_dim, group) and a cache of `kv_dtype` (fp32 or bf16); None when
    switched off, when the panel GEMM or decode-attention kernel is, or when it cannot be built here
    (logged once)."""
    if not (enabled() and cpu_gemm.enabled() and cpu_decode.enabled()):
        return None
    functions = native.load(
        "decode-stack", HEAD_DIM=head_dim, GROUP=group, SWIFTKV_NO_AVX512=0, KV_BF16=build.kv_bf16(kv_dtype)
    )
    return None if functions is None else functions.decode_stack
