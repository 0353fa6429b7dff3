"""The exponential race of seeded sampling on CPU as one compiled C kernel: for each row, the token
argmax(probs / q) with q drawn exactly as `torch.empty_like(probs[b]).exponential_(generator=g_b)`
draws it, and each generator left in the state torch would leave it in (sampler.py's draw; the
reference's algorithm, swiftkv_reference/sampling.py).

Why: torch draws those exponentials one at a time on one thread, about 1 ms for a 49,152-token row on
a 2-core AMD EPYC Zen 4, so a step of 16 sampled requests spent ~17 ms drawing beside a ~38 ms decode
step (the issue-4 mix at temperature 0.7 ran at 0.63x its greedy throughput: 188.5 against 300.7
tok/s). The race needs every draw of the generator, not every exponential: the kernel runs the
generator itself (torch's CPU generator is an MT19937; its state is read with `get_state` and written
back with `set_state`), rows in parallel, and computes q's logarithm only for the few tokens that
could win: 16 rows in 0.9 ms instead of 21, and that mix at 263 tok/s.

Torch's draw of one fp32 exponential (ATen's exponential_distribution<double> on CPU): two 32-bit
outputs w1, w2 of the MT19937; u = ((w1 << 32 | w2) mod 2^53) * 2^-53, uniform in [0, 1);
q = (float)(-log1p(-u)). A token's ratio r = p / q (fp32) is at most p / u * (1 + 2^-21): q >= u
before rounding (-log1p(-u) >= u), and each of the three roundings (log1p, the cast, the division)
moves it by at most 2^-23 relative while r is a normal number. So a token whose p * (1 + 2^-20) is
below best * u cannot beat the best ratio so far and its log1p is skipped; every other token gets the
exact q and r. Ties keep the lowest index and a NaN ratio wins (the first one), as torch's argmax.

    Worked example, one row of 4 tokens, probs (0.5, 0.3, 0.15, 0.05), uniforms (0.9, 0.2, 0.001, 0.5):
    token 0: nothing to beat yet: q = 2.303, r = 0.217, best = 0.217
    token 1: 0.3 >= 0.217 * 0.2 = 0.043: q = 0.223, r = 1.344, best = 1.344
    token 2: 0.15 >= 1.344 * 0.001: q = 0.0010005, r = 149.9, best = 149.9 (a rare draw wins)
    token 3: 0.05 < 149.9 * 0.5: skipped (its r would be 0.072); the token is 2

The layout of the generator's state (the byte offsets of `left`, `next` and the 624 words) and the
draw itself are checked once per process against torch's own `exponential_` on generators in several
states (`_self_check`): on a torch whose generator differs, the kernel is not used (one warning) and
the sampler keeps torch's draw. SWIFTKV_CPU_SAMPLE_KERNEL=0 turns it off.

`topk_values` (the same source) gives top-p its sorted prefix: the k largest values of each row.
"""

from __future__ import annotations

import ctypes
import os

import torch

from swiftkv_fast.kernels import cpu_compile
from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

ENV_SWITCH = "SWIFTKV_CPU_SAMPLE_KERNEL"
STATE_BYTES = 5056  # len(torch.Generator().get_state()) on CPU: the serialized MT19937 and normal cache

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MT_N 624
#define MT_M 397
#define LEFT_AT 8       /* int32: outputs left before the next twist, plus one */
#define NEXT_AT 16      /* uint64: index of the next output word */
#define WORDS_AT 24     /* uint64[624]: the 32-bit state words, zero-extended */
#define CHUNK 2048      /* draws per pass (4,096 words: 16 KiB on the stack) */
#define SLACK (1.0 + 0x1p-20)

static inline uint32_t mt_mix(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((0u - (v & 1u)) & 0x9908b0dfu);
}

/* the next 624 words (three loops without a modulo, so that the compiler vectorizes them) */
static void mt_twist(uint32_t *mt) {
    int k = 0;
    for (; k < MT_N - MT_M; k++) mt[k] = mt[k + MT_M] ^ mt_mix(mt[k], mt[k + 1]);
    for (; k < MT_N - 1; k++) mt[k] = mt[k + MT_M - MT_N] ^ mt_mix(mt[k], mt[k + 1]);
    mt[MT_N - 1] = mt[MT_M - 1] ^ mt_mix(mt[MT_N - 1], mt[0]);
}

static inline uint32_t mt_temper(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}

/* the generator's next n outputs into out, as n calls of torch's mt19937 would return them */
static void mt_fill(uint32_t *mt, int32_t *left, uint64_t *next, uint32_t *out, int64_t n) {
    while (n > 0) {
        int64_t avail = (int64_t)*left - 1;
        if (avail <= 0) {
            mt_twist(mt);
            *left = MT_N + 1;
            *next = 0;
            avail = MT_N;
        }
        const int64_t k = n < avail ? n : avail;
        const uint32_t *src = mt + *next;
        for (int64_t j = 0; j < k; j++) out[j] = mt_temper(src[j]);
        *left -= (int32_t)k;
        *next += (uint64_t)k;
        out += k;
        n -= k;
    }
}

/* u = ((w1 << 32 | w2) mod 2^53) * 2^-53 from two halves, each product and the sum exact */
static inline double uniform(uint32_t w1, uint32_t w2) {
    return (double)(w1 & 0x1fffffu) * 0x1p-21 + (double)w2 * 0x1p-53;
}

/* argmax over V of p[i] / q[i], q[i] the i-th exponential of the generator `state` (advanced in
   place); -1 when the state is not one torch's generator can be in */
static int64_t race_row(const float *p, int64_t V, uint8_t *state) {
    int32_t left;
    uint64_t next;
    uint32_t mt[MT_N], words[2 * CHUNK];
    uint8_t candidate[CHUNK];
    memcpy(&left, state + LEFT_AT, 4);
    memcpy(&next, state + NEXT_AT, 8);
    for (int i = 0; i < MT_N; i++) {
        uint64_t w;
        memcpy(&w, state + WORDS_AT + 8 * i, 8);
        if (w >> 32) return -1;
        mt[i] = (uint32_t)w;
    }
    if (left < 1 || left > MT_N || next > MT_N || next + (uint64_t)left - 1 > MT_N) return -1;
    float best = -INFINITY;
    int64_t arg = 0;
    for (int64_t a = 0; a < V; a += CHUNK) {
        const int64_t n = V - a < CHUNK ? V - a : CHUNK;
        const float *pa = p + a;
        mt_fill(mt, &left, &next, words, 2 * n);
        if (isnan(best)) continue;  /* the first NaN ratio won; the draws still advance the state */
        /* a vectorized pass against the best at the chunk's start (it only grows, so this keeps every
           token that can win), then the exact ratios of the candidates, in order */
        const double limit = best >= 0x1p-100f ? (double)best : 0.0;
        for (int64_t j = 0; j < n; j++)
            candidate[j] = !((double)pa[j] * SLACK < limit * uniform(words[2 * j], words[2 * j + 1]));
        for (int64_t j = 0; j < n; j++) {
            if (!candidate[j]) continue;
            const double u = uniform(words[2 * j], words[2 * j + 1]);
            if (best >= 0x1p-100f && (double)pa[j] * SLACK < (double)best * u) continue;
            float r;
            if (u == 0.0) {
                r = pa[j] > 0.0f ? INFINITY : NAN;  /* q = +0: p / q, without relying on zero signs */
            } else {
                const float q = (float)(-log1p(-u));
                r = pa[j] / q;
            }
            if (isnan(r) ? !isnan(best) : r > best) {
                best = r;
                arg = a + j;
            }
        }
    }
    memcpy(state + LEFT_AT, &left, 4);
    memcpy(state + NEXT_AT, &next, 8);
    for (int i = 0; i < MT_N; i++) {
        const uint64_t w = mt[i];
        memcpy(state + WORDS_AT + 8 * i, &w, 8);
    }
    return arg;
}

/* out (B, k), rows k apart: the k largest values of each row of x (B, V), rows x_stride apart, in
   descending order (torch.topk(x, k).values); a min-heap of the k largest so far, one compare per value
   that does not enter it. NaN never enters (its row is the caller's to handle). */
int swiftkv_topk_values(const float *x, int64_t x_stride, int64_t B, int64_t V, int64_t k, float *out,
                        int num_threads) {
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const float *row = x + b * x_stride;
        float *heap = out + b * k;
        for (int64_t i = 0; i < k; i++) heap[i] = -INFINITY;
        for (int64_t i = 0; i < V; i++) {
            const float v = row[i];
            if (!(v > heap[0])) continue;
            int64_t j = 0;  /* replace the root, sift down */
            for (;;) {
                int64_t c = 2 * j + 1;
                if (c >= k) break;
                if (c + 1 < k && heap[c + 1] < heap[c]) c++;
                if (!(heap[c] < v)) break;
                heap[j] = heap[c];
                j = c;
            }
            heap[j] = v;
        }
        /* heap sort in place: repeatedly move the minimum to the end -> descending order */
        for (int64_t n = k; n > 1; n--) {
            const float last = heap[n - 1];
            heap[n - 1] = heap[0];
            int64_t j = 0;
            for (;;) {
                int64_t c = 2 * j + 1;
                if (c >= n - 1) break;
                if (c + 1 < n - 1 && heap[c + 1] < heap[c]) c++;
                if (!(heap[c] < last)) break;
                heap[j] = heap[c];
                j = c;
            }
            heap[j] = last;
        }
    }
    return 0;
}

/* probs: (B, V) fp32, rows p_stride apart; states: (B, state_stride) bytes, one generator each,
   advanced in place; out: (B,) int64 tokens (-1 for a row whose state is not valid) */
int swiftkv_exponential_race(const float *probs, int64_t p_stride, int64_t B, int64_t V,
                             uint8_t *states, int64_t state_stride, int64_t *out, int num_threads) {
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (B > 1)
    for (int64_t b = 0; b < B; b++) out[b] = race_row(probs + b * p_stride, V, states + b * state_stride);
    return 0;
}
"""

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SYMBOLS = {
    # probs, p_stride, B, V, states, state_stride, out, num_threads
    "swiftkv_exponential_race": [_P, _I64, _I64, _I64, _P, _I64, _P, _INT],
    # x, x_stride, B, V, k, out, num_threads
    "swiftkv_topk_values": [_P, _I64, _I64, _I64, _I64, _P, _INT],
}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


_resolved: list = []  # [the kernel or None], once per process, after the self-check


def _kernel():
    if not _resolved:
        kernels = cpu_compile.load("cpu-sample", SOURCE, {}, SYMBOLS) if enabled() else None
        race = None if kernels is None else kernels["swiftkv_exponential_race"]
        if race is not None and not _self_check(race):
            race = None
        _resolved.append(race)
    return _resolved[0]


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor | None:
    """(B,) int64: per row b, (probs[b] / q).argmax() with q = torch.empty_like(probs[b]).exponential_(
    generator=generators[b]), and generators[b] advanced exactly as that draw advances it. probs:
    (B, V) fp32 CPU rows (any row stride). None, with every generator untouched, when the kernel does
    not apply (not fp32 CPU rows, a generator not on the CPU) or is unavailable."""
    if not (probs.is_cpu and probs.dtype == torch.float32 and probs.dim() == 2 and probs.stride(1) == 1):
        return None
    if len(generators) != probs.shape[0] or probs.shape[1] == 0:
        return None
    if any(g is None or g.device.type != "cpu" for g in generators):
        return None
    race = _kernel()
    if race is None:
        return None
    return _run(race, probs, generators)


def topk_values(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """torch.topk(x, k, dim=-1).values for fp32 CPU rows x (B, V) without NaN, 1 <= k <= V: (B, k), each
    row descending; None when the kernel does not apply or is unavailable. Top-p's sorted prefix
    (sampler.py): a heap pass over each row; the top 64 of 16 x 49,152 probabilities in 0.5 ms, torch's
    topk 1.0 ms (2-core AMD EPYC Zen 4)."""
    if not (x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1):
        return None
    if not 1 <= k <= x.shape[1] or not enabled():
        return None
    kernels = cpu_compile.load("cpu-sample", SOURCE, {}, SYMBOLS)
    if kernels is None:
        return None
    out = torch.empty(x.shape[0], k, dtype=torch.float32)
    kernels["swiftkv_topk_values"](
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], k, out.data_ptr(), torch.get_num_threads()
    )
    return out


def _run(race, probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor | None:
    states = torch.stack([g.get_state() for g in generators])  # (B, STATE_BYTES) uint8
    if states.shape[1] != STATE_BYTES:
        return None
    tokens = torch.empty(probs.shape[0], dtype=torch.int64)
    race(
        probs.data_ptr(),
        probs.stride(0),
        probs.shape[0],
        probs.shape[1],
        states.data_ptr(),
        states.stride(0),
        tokens.data_ptr(),
        torch.get_num_threads(),
    )
    if bool((tokens < 0).any()):
        return None
    for g, state in zip(generators, states):
        g.set_state(state.clone())  # a row of its own: set_state misreads a view into a larger tensor
    return tokens


def torch_race(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The specification, and the sampler's path where the kernel does not run: torch's own draw, one
    row at a time (one generator per request)."""
    q = torch.stack([torch.empty_like(probs[b]).exponential_(generator=g) for b, g in enumerate(generators)])
    return (probs / q).argmax(dim=-1)


def _self_check(race) -> bool:
    """The kernel against torch's draw on generators whose next output falls at several places of the
    MT19937's 624-word block (fresh, mid-block, the last word), flat and peaked rows, rows with zeros
    (top-k / top-p), 1 to 5,000 tokens: the same tokens and the same generator states afterwards."""
    cases = []
    for seed, words in [(0, 0), (1, 1), (2**40 + 3, 311), (7, 622), (123, 623), (5, 624 * 3 + 17)]:
        g = torch.Generator().manual_seed(seed)
        if words:
            torch.empty(words, dtype=torch.int32).random_(generator=g)  # one 32-bit output each
        cases.append(g)
    rng = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 2049, 5000):
        logits = torch.randn(len(cases), vocab, generator=rng) * torch.tensor([0.1, 1, 3, 10, 30, 3])[:, None]
        logits[2, ::3] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        mine = [_clone(g) for g in cases]
        theirs = [_clone(g) for g in cases]
        tokens = _run(race, probs, mine)
        expected = torch_race(probs, theirs)
        same_states = all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(mine, theirs))
        if tokens is None or not torch.equal(tokens, expected) or not same_states:
            logger.warning(
                "cpu-sample: the C kernel does not reproduce torch %s's exponential_ here (vocab %d); "
                "sampling keeps torch's draw",
                torch.__version__,
                vocab,
            )
            return False
        cases = theirs  # the next vocabulary starts from the advanced states
    return True


def _clone(g: torch.Generator) -> torch.Generator:
    c = torch.Generator()
    c.set_state(g.get_state())
    return c
