"""Stop rules, checked after each sampled token (vLLM's names for finish reasons).

Before `min_tokens` outputs, EOS / stop tokens / stop strings do not stop the request; the sampler
does not even produce its EOS (unless ignore_eos) and `stop_token_ids` then: their logits are masked
to -inf (`min_tokens_banned_ids`, as vLLM's min-tokens logits processor). Then: EOS (unless
ignore_eos) and `stop_token_ids` -> "stop"; a stop string in the text -> "stop" with the text cut
before it; `max_tokens` outputs or `max_model_len` total tokens -> "length".

Stop strings and min_tokens (vLLM's detokenizer): the text of the first `min_tokens` outputs never
stops the request. A stop string counts only if it ends in later text (it may start before the
boundary), so it is searched from `boundary - len(stop) + 1`. The output keeps every token id and
its text is the detokenization of those ids, cut before the stop string: as it is checked after
every token, the stop string ends in the text of the last token.
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
    if sp.stop and detokenize is not None and req.num_output_tokens > sp.min_tokens:
        text = detokenize(req.output_token_ids)
        boundary = len(detokenize(req.output_token_ids[: sp.min_tokens])) if sp.min_tokens else 0
        hit = find_stop_string(text, sp.stop, boundary)
        if hit is not None:
            pos, s = hit
            req.output_text = text[:pos]
            return _finish(req, "stop", s)
    if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= max_model_len:
        return _finish(req, "length", None)
    return False


def find_stop_string(text: str, stop: list[str], boundary: int) -> tuple[int, str] | None:
    """The earliest (position, stop string) in `text` that ends after `text[:boundary]`, or None."""
    hits = [(text.find(s, max(0, boundary - len(s) + 1)), s) for s in stop]
    return min(((pos, s) for pos, s in hits if pos >= 0), default=None)


def _finish(req: Request, reason: str, stop_reason: int | str | None) -> bool:
    req.finish_reason = reason
    req.stop_reason = stop_reason
    return True
