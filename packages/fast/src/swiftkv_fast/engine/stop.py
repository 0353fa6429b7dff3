"""Stop rules, checked after each sampled token (vLLM's names for finish reasons).

Before `min_tokens` outputs, EOS / stop tokens / stop strings do not stop the request; the sampler
does not even produce its EOS (unless ignore_eos) and `stop_token_ids` then: their logits are masked
to -inf (`min_tokens_banned_ids`, as vLLM's min-tokens logits processor). Then: EOS (unless
ignore_eos) and `stop_token_ids` -> "stop"; a stop string in the text -> "stop" with the text cut
before it; `max_tokens` outputs or `max_model_len` total tokens -> "length".
"""

from __future__ import annotations

from collections.abc import Callable

from swiftkv_fast.engine.request import Request


def min_tokens_banned_ids(req: Request, eos_token_ids: set[int] | frozenset[int]) -> list[int]:
    """The token ids the request's next sampled token must not be: while it has fewer than
    `min_tokens` outputs, its EOS ids (unless ignore_eos) and `stop_token_ids`; else none."""
    sp = req.sampling_params
    if req.num_output_tokens >= sp.min_tokens:
        return []
    ids = set(sp.stop_token_ids)
    if not sp.ignore_eos:
        ids |= eos_token_ids
    return sorted(ids)


def check_stop(
    req: Request,
    token: int,
    eos_token_ids: set[int],
    max_model_len: int,
    detokenize: Callable[[list[int]], str] | None,
) -> bool:
    sp = req.sampling_params
    if req.num_output_tokens >= sp.min_tokens:
        if token in eos_token_ids and not sp.ignore_eos:
            return _finish(req, "stop", None)
        if token in sp.stop_token_ids:
            return _finish(req, "stop", token)
        if sp.stop and detokenize is not None:
            text = detokenize(req.output_token_ids)
            hits = [(text.find(s), s) for s in sp.stop if s in text]
            if hits:
                pos, s = min(hits)
                req.output_text = text[:pos]
                return _finish(req, "stop", s)
    if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= max_model_len:
        return _finish(req, "length", None)
    return False


def _finish(req: Request, reason: str, stop_reason: int | str | None) -> bool:
    req.finish_reason = reason
    req.stop_reason = stop_reason
    return True
