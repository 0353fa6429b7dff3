"""The exponential race of seeded sampling on CPU as one C kernel (csrc/sample.c): for each row, the
token argmax(probs / q) with q drawn exactly as `torch.empty_like(probs[b]).exponential_(generator=g_b)`
draws it, and each generator left in the state torch would leave it in (sampler.py's draw; the
reference's algorithm, swiftkv_reference/sampling.py).

Why: torch draws those exponentials one at a time on one thread, about 1 ms for a 49,152-token row,
which made sampled decoding far slower than greedy. The race needs every draw of the generator, not
every exponential: the kernel runs the generator itself (torch's CPU generator is an MT19937; its state
is read with `get_state` and written back with `set_state`), rows in parallel, and computes q's
logarithm only for the few tokens that could win (csrc/sample.c shows why that is exact, with a worked
example).

The layout of the generator's state (the byte offsets of `left`, `next` and the 624 words) and the
draw itself are checked once per process against torch's own `exponential_` on generators in several
states (`_self_check`): on a torch whose generator differs, `load` returns None (one warning) and the
sampler keeps torch's draw. The kernel plan (kernels/plan.py) loads it once per engine unless `sample`
is in its disabled kernels.

`topk_values` (the same source) gives top-p its sorted prefix: the k largest values of each row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from swiftkv_fast.kernels import native
from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

KERNEL = "sample"  # its name in SWIFTKV_DISABLED_KERNELS (envs.py)
STATE_BYTES = 5056  # len(torch.Generator().get_state()) on CPU: the serialized MT19937 and normal cache


@dataclass(frozen=True)
class SampleKernels:
    race: Callable  # the exponential race, checked against torch's draw
    topk_values: Callable


_checked: dict[int, bool] = {}  # id of a loaded library -> its race reproduces torch's draw here


def load() -> SampleKernels | None:
    """The built kernels, or None where they cannot be built or their race does not reproduce torch's
    draw on this torch (checked once per process)."""
    kernels = native.load("sample")
    if kernels is None:
        return None
    if id(kernels) not in _checked:
        _checked[id(kernels)] = _self_check(kernels.exponential_race)
    return SampleKernels(kernels.exponential_race, kernels.topk_values) if _checked[id(kernels)] else None


def exponential_race(
    kernels: SampleKernels, probs: torch.Tensor, generators: list[torch.Generator]
) -> torch.Tensor | None:
    """(B,) int64: per row b, (probs[b] / q).argmax() with q = torch.empty_like(probs[b]).exponential_(
    generator=generators[b]), and generators[b] advanced exactly as that draw advances it. probs:
    (B, V) fp32 CPU rows (any row stride). None, with every generator untouched, for a generator not on
    the CPU or whose state is not torch's CPU layout (the caller then draws with torch)."""
    if not (probs.is_cpu and probs.dtype == torch.float32 and probs.dim() == 2):
        raise ValueError(f"exponential_race: fp32 CPU (B, V) rows, got {probs.dtype} {tuple(probs.shape)}")
    if len(generators) != probs.shape[0] or probs.shape[1] == 0:
        raise ValueError(f"exponential_race: {len(generators)} generators for {tuple(probs.shape)} rows")
    if any(g is None or g.device.type != "cpu" for g in generators):
        return None
    return _run(kernels.race, probs if probs.stride(1) == 1 else probs.contiguous(), generators)


def topk_values(kernels: SampleKernels, x: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk(x, k, dim=-1).values for fp32 CPU rows x (B, V) without NaN, 1 <= k <= V: (B, k), each
    row descending. Top-p's sorted prefix (sampler.py): a heap pass over each row."""
    if not (x.is_cpu and x.dtype == torch.float32 and x.dim() == 2) or not 1 <= k <= x.shape[1]:
        raise ValueError(
            f"topk_values: fp32 CPU (B, V) rows and 1 <= k <= V, got {x.dtype} {tuple(x.shape)}, {k}"
        )
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], k, dtype=torch.float32)
    kernels.topk_values(
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
