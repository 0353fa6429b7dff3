"""Small C kernels for the CPU, compiled at first use with the system C compiler and loaded with ctypes.

`load(name, source, defines, symbols)` builds `source` once per process and set of defines ($CC, else
`cc`; -O3 -march=native, so for this machine's SIMD; -fopenmp when torch's parallel backend is OpenMP,
whose runtime the kernels then share) in a private temporary directory, and returns the requested
functions with their ctypes signatures: about a fifth of a second per build. A compiler without
OpenMP gets a one-thread build. Without a compiler, or when no build loads, it returns None (one
warning per build) and the caller keeps its portable path. The kernels of kernels/cpu_decode.py and
kernels/cpu_ops.py are built here.

`SWIFTKV_CPU_MAX_ISA=avx2` (or `avx512`) builds every kernel for a lesser CPU than this one: no AVX-512
and no AMX (or no AMX), so that one machine can measure what another kind gets. With
`ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2` torch and its
libraries do the same (bench/README.md).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",  # vectorized dot products and sums (fp32 reassociation, as in a GEMM)
    "-fno-signed-zeros",
    "-fPIC",
    "-shared",
]

ISA_SWITCH = "SWIFTKV_CPU_MAX_ISA"
# what each setting of ISA_SWITCH turns off, after -march=native
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
ISA_FLAGS = {"native": [], "avx512": _NO_AMX, "avx2": ["-mno-avx512f", *_NO_AMX]}


def max_isa() -> str:
    """The instruction sets the kernels are built for (ISA_SWITCH; default "native")."""
    value = os.environ.get(ISA_SWITCH, "native").lower() or "native"
    if value not in ISA_FLAGS:
        raise ValueError(f"{ISA_SWITCH}={value!r}: expected one of {sorted(ISA_FLAGS)}")
    return value


# e^x in fp32 for the kernels' sources (Cephes expf: 2^n * p(r), n = round(x / ln 2), |r| <= ln(2) / 2;
# about 1 ulp), branch-free so that the compiler vectorizes loops over it; x is clamped to [-87, 88]
EXPF = r"""
#ifndef SWIFTKV_EXPF
#define SWIFTKV_EXPF
#include <stdint.h>
#include <string.h>
/* The steps on a float or on a GCC vector of floats (kernels/cpu_prefill.py's vexpf): n is
   floor(x * SWIFTKV_EXP_LOG2E + 0.5), r = SWIFTKV_EXP_REDUCE(x, n), e^x = SWIFTKV_EXP_POLY(r) * 2^n */
#define SWIFTKV_EXP_LOG2E 1.44269504088896341f
#define SWIFTKV_EXP_REDUCE(x, n) ((x) - (n) * 0.693359375f + (n) * 2.12194440e-4f)
#define SWIFTKV_EXP_POLY(r)                                                                          \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) \
       * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.0f)
static inline float swiftkv_expf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_floorf(x * SWIFTKV_EXP_LOG2E + 0.5f);
    float r = SWIFTKV_EXP_REDUCE(x, n);
    float p = SWIFTKV_EXP_POLY(r);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}
#endif
"""

# The model's row ops, shared by kernels/cpu_ops.py (as ops of their own), kernels/cpu_gemm.py (fused
# into the packing of a GEMM's input) and kernels/cpu_decode_stack.py, so all compute them alike:
# RMSNorm with the residual add in front, SiLU-and-mul, RoPE. Needs EXPF before it. EXPF and ROW_OPS
# are guarded, so that a source made of several kernels' sources defines them once.
ROW_OPS = r"""
#ifndef SWIFTKV_ROW_OPS
#define SWIFTKV_ROW_OPS
#include <math.h>
/* h += d in place (d NULL: no add) over H values; returns RMSNorm's scale 1 / sqrt(mean(h^2) + eps):
   the normed row is then (h[i] * scale) * w[i] */
static inline float swiftkv_add_rms_scale(float *h, const float *d, int64_t H, float eps) {
    float ss = 0.f;
    if (d != NULL) {
        for (int64_t i = 0; i < H; i++) {
            const float x = h[i] + d[i];
            h[i] = x;
            ss += x * x;
        }
    } else {
        for (int64_t i = 0; i < H; i++) ss += h[i] * h[i];
    }
    return 1.f / sqrtf(ss / (float)H + eps);
}

static inline float swiftkv_silu_mul(float gate, float up) { return gate / (1.f + swiftkv_expf(-gate)) * up; }

/* out[i] = silu(gate[i]) * up[i] over n values. Kept out of line: inlined into a caller's loop over rows,
   gcc 12 vectorized it 6x worse (4,096 x 1,536 values on one Intel Xeon core: 39 against 7 ms). */
static __attribute__((noinline, unused)) void swiftkv_silu_mul_row(const float *gate, const float *up,
                                                                   float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = swiftkv_silu_mul(gate[i], up[i]);
}

/* Rotate-half RoPE in place on one token's `heads` heads of D values (x): with its position's table
   rows c, s (D / 2 each), a = x[:D/2], b = x[D/2:] become a c - b s, b c + a s */
static inline void swiftkv_rope_row(float *x, int64_t heads, int64_t D, const float *c, const float *s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *a = x + h * D, *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * c[i] - x2 * s[i];
            b[i] = x2 * c[i] + x1 * s[i];
        }
    }
}
#endif
"""

# The KV cache's element type for the kernels that read or write it: kv_t is float, or with -DKV_BF16=1
# bfloat16 held as uint16_t (engine kv_cache_dtype="bfloat16"). Rows go to the cache rounded to nearest
# even, as torch's .to(torch.bfloat16) rounds (a NaN becomes 0x7fc0), and come back exactly (bf16 is
# fp32's upper half). Guarded, like EXPF.
KV_TYPES = r"""
#ifndef SWIFTKV_KV_TYPES
#define SWIFTKV_KV_TYPES
#include <stdint.h>
#include <string.h>
#ifndef KV_BF16
#define KV_BF16 0
#endif
static inline float swiftkv_bf16_to_float(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t swiftkv_float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* n values of a float row rounded into bf16 (whatever KV_BF16 is: cpu_ops' write_kv picks at run time) */
static inline void swiftkv_bf16_store(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = swiftkv_float_to_bf16(src[i]);
}
#if KV_BF16
typedef uint16_t kv_t;
#else
typedef float kv_t;
#endif
/* n values of a float row into the cache, and back */
static inline void swiftkv_kv_store(kv_t *dst, const float *src, int64_t n) {
#if KV_BF16
    swiftkv_bf16_store(dst, src, n);
#else
    memcpy(dst, src, sizeof(float) * n);
#endif
}
static inline void swiftkv_kv_load(float *dst, const kv_t *src, int64_t n) {
#if KV_BF16
    for (int64_t i = 0; i < n; i++) dst[i] = swiftkv_bf16_to_float(src[i]);
#else
    memcpy(dst, src, sizeof(float) * n);
#endif
}
#endif
"""


def kv_bf16(dtype: torch.dtype) -> int | None:
    """The KV_BF16 define for a cache of `dtype` (KV_TYPES): 0 for fp32, 1 for bf16, None for a dtype the
    C kernels do not read."""
    return {torch.float32: 0, torch.bfloat16: 1}.get(dtype)


_lock = threading.Lock()
_built: dict[tuple, dict[str, ctypes._CFuncPtr] | None] = {}  # None: it did not build here
_NOT_BUILT = object()


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else `cc`; None when not on PATH."""
    return shutil.which(os.environ.get("CC", "cc"))


def _openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def load(
    name: str, source: str, defines: dict[str, int], symbols: dict[str, list]
) -> dict[str, ctypes._CFuncPtr] | None:
    """The functions `symbols` ({symbol: argtypes}, each returning int) of `source` compiled with
    `defines`; built at the first call per (name, defines), None when it cannot be built or loaded."""
    key = (name, max_isa(), *defines.items())
    functions = _built.get(key, _NOT_BUILT)  # a lock-free look first: every step's ops ask
    if functions is not _NOT_BUILT:
        return functions
    with _lock:
        if key not in _built:
            _built[key] = _build(name, source, defines, symbols)
        return _built[key]


def _build(name: str, source: str, defines: dict[str, int], symbols: dict[str, list]):
    what = f"{name} ({', '.join(f'{k}={v}' for k, v in defines.items())})" if defines else name
    cc = compiler()
    if cc is None:
        logger.warning("%s: no C compiler (cc / $CC) found; using the portable torch path", what)
        return None
    flags = [*FLAGS, *ISA_FLAGS[max_isa()], *(f"-D{k}={v}" for k, v in defines.items())]
    errors = []
    for openmp in [True, False] if _openmp() else [False]:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"swiftkv-{name}-") as tmp:
            src, lib = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            cmd = [cc, *flags, *(["-fopenmp"] if openmp else []), str(src), "-o", str(lib)]
            try:
                subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
                library = ctypes.CDLL(str(lib))  # mapped: the file may go now
                functions = {symbol: getattr(library, symbol) for symbol in symbols}
            except (OSError, AttributeError, subprocess.SubprocessError) as e:
                errors.append((getattr(e, "stderr", None) or str(e)).strip())
                continue
        for symbol, argtypes in symbols.items():
            functions[symbol].argtypes, functions[symbol].restype = argtypes, ctypes.c_int
        logger.info(
            "%s: C kernel built in %.2f s (%s, %s)",
            what,
            time.perf_counter() - start,
            os.path.basename(cc),
            "OpenMP" if openmp else "one thread",
        )
        return functions
    logger.warning(
        "%s: the C kernel did not build (%s); using the portable torch path", what, " / ".join(errors)
    )
    return None
