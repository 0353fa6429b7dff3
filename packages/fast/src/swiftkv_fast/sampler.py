"""Batched sampling that reproduces the reference algorithm token for token (docs/interfaces.md).

Per row: logprobs = log_softmax(logits) of the raw logits; then the row's banned ids (min_tokens: its
EOS and stop token ids while it has fewer than min_tokens outputs) are set to -inf; greedy = argmax;
else x = logits / T, top-k, top-p (stable descending sort, keep while cum - p < top_p; `_apply_top_p`
sorts only the kept prefix),
probs = softmax(x), token = argmax(probs / q) with q ~ Exp(1) drawn from the request's own CPU
generator (one draw of vocab_size values per token; on CPU kernels/cpu_sample.py runs that race
without computing every exponential, with the same tokens and generator states). With nothing banned
this is the reference's algorithm exactly; the reported logprobs never see the mask (vLLM's raw
logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from swiftkv_fast.kernels import cpu_ops, cpu_sample
from swiftkv_fast.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    chosen_logprobs: list[float]  # per row: log_softmax(raw logits)[its token]
    logprobs: torch.Tensor | None  # (B, vocab) fp32 log_softmax of the raw logits; None unless asked for


def _apply_top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    # x: (B, V); top_k: (B,) with k > 0
    values = torch.topk(x, int(top_k.max()), dim=-1).values  # (B, max_k)
    kth = values.gather(1, (top_k - 1)[:, None])  # (B, 1)
    return x.masked_fill(x < kth, float("-inf"))


# the sorted prefix top-p looks at first, x4 for the rows whose cut lies beyond it, up to the last
# size before a row is sorted whole: on chat prompts a nucleus holds a few tokens (under 100 at the 99th
# percentile for top_p 0.95); after random-token prompts (the benchmarks') it can hold thousands
TOP_P_CANDIDATES = 64
TOP_P_MAX_CANDIDATES = 1024


def _sorted_prefix(probs: torch.Tensor, k: int, kernels: cpu_sample.SampleKernels | None) -> torch.Tensor:
    """(B, k): the k largest values of each row of probs (B, V) without NaN, descending."""
    if k == probs.shape[-1]:
        return torch.sort(probs, dim=-1, descending=True).values
    if kernels is not None:
        return cpu_sample.topk_values(kernels, probs, k)
    return torch.topk(probs, k, dim=-1).values


def _apply_top_p(
    x: torch.Tensor, top_p: torch.Tensor, kernels: cpu_sample.SampleKernels | None = None
) -> torch.Tensor:
    """x (B, V) with the reference's top-p drop (sampling.py step 5) set to -inf; top_p: (B,) in (0, 1).

    The reference sorts each row's probabilities (descending, stable) and drops sorted position i when
    cum_i - p_i >= top_p. Along the sorted order cum_i - p_i never decreases, so the kept tokens are a
    prefix of it, and only that prefix has to be sorted: the TOP_P_CANDIDATES largest values (x4 for
    the rows whose first dropped position lies beyond them, a whole sort past TOP_P_MAX_CANDIDATES)
    are the sorted prefix, with the same cumulative sums (the cumsum of a prefix is the prefix of the
    cumsum). With m tokens kept and the m-th largest value c, the kept set is every token above c and,
    of those equal to c, the lowest ids (the stable sort's order). A full sort of a row of the
    vocabulary costs far more than its top 64 (kernels/cpu_sample.py). A row with a NaN (every
    softmax entry then is) drops nothing, as in the reference."""
    probs = torch.softmax(x, dim=-1)
    batch, vocab = probs.shape
    nan_rows = probs.sum(-1).isnan()  # (B,)
    num_kept = torch.full((batch, 1), vocab, dtype=torch.int64)  # NaN rows: every token
    cut = torch.zeros(batch, 1, dtype=probs.dtype)  # (B, 1): the smallest kept probability
    todo = (~nan_rows).nonzero().squeeze(1)
    k = min(vocab, TOP_P_CANDIDATES)
    while todo.numel():
        values = _sorted_prefix(probs[todo], k, kernels)  # (n, k)
        cum = torch.cumsum(values, dim=-1)
        drop = (cum - values) >= top_p[todo, None]
        drop[:, 0] = False
        done = drop[:, -1] | (k == vocab)
        kept = (~drop[done]).sum(-1, keepdim=True)
        num_kept[todo[done]] = kept
        cut[todo[done]] = values[done].gather(1, kept - 1)
        todo = todo[~done]
        k = min(vocab, 4 * k) if 4 * k <= TOP_P_MAX_CANDIDATES else vocab
    keep = probs >= cut
    if bool((keep.sum(-1, keepdim=True) > num_kept).any()):  # a run of ties crosses the cut somewhere
        above, tied = probs > cut, probs == cut
        keep = above | (tied & (tied.cumsum(-1) <= num_kept - above.sum(-1, keepdim=True)))
    keep |= nan_rows[:, None]
    return x.masked_fill(~keep, float("-inf"))


def _mask_banned(logits: torch.Tensor, banned: list[list[int]] | None) -> torch.Tensor:
    """`logits` with `banned[i]` set to -inf in row i (one index_put on a copy); the input is untouched.
    Ids outside the vocabulary are ignored (they cannot be sampled anyway)."""
    if not banned or not any(banned):
        return logits
    vocab = logits.shape[-1]
    pairs = [(i, t) for i, ids in enumerate(banned) for t in ids if 0 <= t < vocab]
    if not pairs:
        return logits
    rows, cols = torch.tensor(pairs).unbind(1)
    return logits.index_put((rows, cols), torch.tensor(float("-inf"), dtype=logits.dtype))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[list[int]] | None = None,
    *,
    full_logprobs: bool = True,
    row_ops: SimpleNamespace | None = None,
    sample_kernels: cpu_sample.SampleKernels | None = None,
) -> SamplerOutput:
    """logits: (B, vocab) fp32 rows on CPU; generators[i] is required for non-greedy rows.

    banned[i] (optional): token ids row i must not produce (see `engine.stop.min_tokens_banned_ids`);
    their logits are -inf for the choice (greedy, top-k, top-p and the exponential race all see the
    masked row), while the returned logprobs stay log_softmax of the raw logits.
    full_logprobs=False: no (B, vocab) logprobs (None), only each row's chosen one, as its logit minus
    the row's logsumexp (equal to log_softmax's up to fp32 rounding); without a mask the argmax and
    the logsumexp come from one kernel's passes over each row (kernels/cpu_ops.py).
    row_ops, sample_kernels: the C kernels the engine's plan chose (kernels/plan.py); None: torch."""
    raw = logits.float()
    logits = _mask_banned(raw, banned)  # raw itself when nothing is banned
    logprobs = torch.log_softmax(raw, dim=-1) if full_logprobs else None
    if row_ops is not None and not full_logprobs and logits is raw:
        tokens, logsumexp = cpu_ops.argmax_logsumexp_rows(row_ops, raw)
    else:
        tokens = cpu_ops.argmax_rows(row_ops, logits) if row_ops is not None else logits.argmax(dim=-1)
        logsumexp = None if full_logprobs else torch.logsumexp(raw, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sel = torch.tensor(rows)
        temps = torch.tensor([params[i].temperature for i in rows], dtype=logits.dtype)
        x = logits[sel] / temps[:, None]
        top_k = torch.tensor([min(params[i].top_k, logits.shape[-1]) for i in rows])
        kr = (top_k > 0).nonzero().squeeze(1)
        if kr.numel():
            x[kr] = _apply_top_k(x[kr], top_k[kr])
        top_p = torch.tensor([params[i].top_p for i in rows], dtype=logits.dtype)
        pr = (top_p < 1).nonzero().squeeze(1)
        if pr.numel():
            x[pr] = _apply_top_p(x[pr], top_p[pr], sample_kernels)
        probs = torch.softmax(x, dim=-1)
        row_generators = [generators[i] for i in rows]
        drawn = None
        if sample_kernels is not None:
            drawn = cpu_sample.exponential_race(sample_kernels, probs, row_generators)
        tokens[sel] = drawn if drawn is not None else cpu_sample.torch_race(probs, row_generators)
    if full_logprobs:
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    else:
        chosen = raw.gather(1, tokens[:, None])[:, 0] - logsumexp
    return SamplerOutput(token_ids=tokens.tolist(), chosen_logprobs=chosen.tolist(), logprobs=logprobs)


def top_logprobs(
    logprobs: torch.Tensor | None, token_ids: list[int], nums: list[int | None]
) -> list[dict[int, float] | None]:
    """Per row: {chosen token: logprob, top-n tokens: logprobs} or None when not requested (logprobs
    may be None only when no row requests any)."""
    out: list[dict[int, float] | None] = [None] * len(nums)
    n_max = max((n for n in nums if n is not None), default=None)
    if n_max is None:
        return out
    if logprobs is None:
        raise ValueError("top_logprobs: logprobs were requested, but the sampler did not compute them")
    top = torch.topk(logprobs, n_max, dim=-1) if n_max > 0 else None
    chosen = logprobs.gather(1, torch.tensor(token_ids)[:, None])[:, 0].tolist()
    for i, n in enumerate(nums):
        if n is None:
            continue
        entry = {token_ids[i]: chosen[i]}
        if n > 0:
            for t, lp in zip(top.indices[i, :n].tolist(), top.values[i, :n].tolist()):
                entry.setdefault(t, lp)
        out[i] = entry
    return out
