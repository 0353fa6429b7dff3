"""The one binding layer of the C kernels: which library exports which functions with which argument
types, and how a kernel's status becomes an exception.

`load(name, **defines)` returns the library LIBRARIES[name] built with `defines` (kernels/build.py) as
a namespace of its functions, or None where it cannot be built here. Every function in `symbols`
returns a status (csrc/common.h's enum swiftkv_status): 0, or a code that the call raises as
ERRORS[code]; the functions in `values` return a plain int. The cpu_*.py modules hold the Python side
of each kernel (which tensors it takes, their checks, the fallback) and call only through here.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace

from swiftkv_fast.kernels import build

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


@dataclass(frozen=True)
class Library:
    source: str  # its file under csrc/
    symbols: dict[str, list] = field(default_factory=dict)  # function -> argtypes; returns a status
    values: dict[str, list] = field(default_factory=dict)  # function -> argtypes; returns an int value


# a paged attention call: q, q_stride, k, v, block_stride, num_blocks, block_tables, bt_stride,
# max_blocks, [cu_q,] seq_lens, out, num_reqs, kv_heads, block_size, window, scale, num_threads
_PAGED_HEAD = [_P, _I64, _P, _P, _I64, _I64, _P, _I64, _I64]
_PAGED_TAIL = [_P, _P, _I64, _I64, _I64, _I64, _F32, _INT]
# write_kv: cache, layer_stride, kv_stride, num_slots, row, k, k_ts, k_ls, v, v_ts, v_ls, slots, T,
# n_layers, num_threads
_WRITE_KV = [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _INT]

LIBRARIES = {
    "row-ops": Library(
        "row_ops.c",
        {
            # h, h_stride, d, d_stride, w, out, T, H, eps, num_threads
            "swiftkv_add_rms_norm": [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _F32, _INT],
            # gu, gu_stride, out, T, I, num_threads
            "swiftkv_silu_and_mul": [_P, _I64, _P, _I64, _I64, _INT],
            # x, x_stride, B, V, out, stats, num_threads
            "swiftkv_argmax_rows": [_P, _I64, _I64, _I64, _P, _P, _INT],
            # x, x_stride, T, heads, D, positions, cos, sin, max_pos, num_threads
            "swiftkv_rope": [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _INT],
            "swiftkv_write_kv": _WRITE_KV,
            "swiftkv_write_kv_bf16": _WRITE_KV,
        },
    ),
    "decode-attention": Library(
        "decode_attention.c", {"swiftkv_decode_attention": [*_PAGED_HEAD, *_PAGED_TAIL]}
    ),
    "prefill-attention": Library(
        "prefill_attention.c", {"swiftkv_prefill_attention": [*_PAGED_HEAD, _P, *_PAGED_TAIL]}
    ),
    "panel-gemm": Library(
        "panel_gemm.c",
        {
            # w, ldw, N, K, packed, num_threads
            "swiftkv_gemm_pack": [_P, _I64, _I64, _I64, _P, _INT],
            # x, ldx, packed, format, bias, y, M, N, K, num_threads, prologue, d, ldd, norm_w, eps
            "swiftkv_gemm": [_P, _I64, _P, _INT, _P, _P, _I64, _I64, _I64, _INT, _INT, _P, _I64, _P, _F32],
        },
        {"swiftkv_gemm_rows_per_block": [], "swiftkv_gemm_has_amx": []},
    ),
    "amx-gemm": Library(
        "amx_gemm.c",
        {
            # w, ldw, N, K, NB, KB, hi, lo, num_threads
            "swiftkv_amx_pack": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _INT],
            # x, ldx, M, N, K, KB, hi, lo, bias, y, xh, num_threads
            "swiftkv_amx_linear": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _INT],
        },
        {"swiftkv_amx_enable": []},  # 0, 1 (Linux refused the tile state) or SWIFTKV_NO_AMX
    ),
    "amx-q4-gemm": Library(
        "amx_q4_gemm.c",
        # x, ldx, M, N, KB, codes, d, m, bias, y, xs, sums, num_threads
        {"swiftkv_amx_q4_linear": [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _INT]},
    ),
    # step, layers, n_layers, groups (kernels/cpu_decode_stack.py's structures), num_threads
    "decode-stack": Library("decode_stack.c", {"swiftkv_decode_stack": [_P, _P, _I64, _P, _INT]}),
    "sample": Library(
        "sample.c",
        {
            # probs, p_stride, B, V, states, state_stride, out, num_threads
            "swiftkv_exponential_race": [_P, _I64, _I64, _I64, _P, _I64, _P, _INT],
            # x, x_stride, B, V, k, out, num_threads
            "swiftkv_topk_values": [_P, _I64, _I64, _I64, _I64, _P, _INT],
        },
    ),
}

# csrc/common.h's enum swiftkv_status -> what a call raises
NO_AMX = 6
ERRORS = {
    1: (MemoryError, "out of memory for the kernel's buffers"),
    2: (ValueError, "a seq_len exceeds its block table, or a request has more queries than positions"),
    3: (ValueError, "a block table reads a block id outside the cache"),
    4: (ValueError, "a position is outside the RoPE table"),
    5: (ValueError, "a KV slot is outside the cache"),
    NO_AMX: (RuntimeError, "the kernel was built without AMX (the compiler does not target it here)"),
}


def _raise_for_status(status: int, function, arguments):
    """ctypes' errcheck of every status-returning kernel: 0 passes, a code raises ERRORS[code]."""
    if status:
        kind, text = ERRORS.get(status, (RuntimeError, f"unknown status {status}"))
        raise kind(f"{function.__name__}: {text}")
    return status


_loaded: dict[tuple, SimpleNamespace | None] = {}  # this process's answers, by what they depend on


def load(name: str, **defines: int) -> SimpleNamespace | None:
    """The functions of LIBRARIES[name] built with `defines`, as attributes without their swiftkv_
    prefix; None where the library cannot be built or loaded here (kernels/build.py logs why, once)."""
    key = (name, build.max_isa(), build.compiler_setting(), *defines.items())
    bound = _loaded.get(key, _NOT_LOADED)  # a lock-free look: every step's ops ask
    if bound is _NOT_LOADED:
        bound = _loaded[key] = _bind(name, defines)
    return bound


_NOT_LOADED = object()


def _bind(name: str, defines: dict[str, int]) -> SimpleNamespace | None:
    spec = LIBRARIES[name]
    lib = build.library(name, spec.source, defines)
    if lib is None:
        return None
    functions = {}
    for symbol, argtypes in (*spec.symbols.items(), *spec.values.items()):
        fn = getattr(lib, symbol)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        if symbol in spec.symbols:
            fn.errcheck = _raise_for_status
        functions[symbol.removeprefix("swiftkv_")] = fn
    return SimpleNamespace(**functions)
