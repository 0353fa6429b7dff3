"""min_tokens as vLLM: before min_tokens outputs, EOS (unless ignore_eos) and stop_token_ids are never
sampled (their logits are -inf for the choice); the reported logprobs stay those of the raw logits; a
stop string counts only if it ends in the text of a later output, and the text is then the kept token
ids' text cut before it."""

from __future__ import annotations

import pytest
import torch
from char_tokenizer import CharTokenizer
from conftest import random_prompts
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.engine.request import Request
from swiftkv_fast.engine.stop import check_stop, min_tokens_banned_ids
from swiftkv_fast.sampler import sample
from swiftkv_reference.sampling import SamplingSettings
from swiftkv_reference.sampling import sample as reference_sample

VOCAB = 64


def _logits(rows: int, favoured: list[int]) -> torch.Tensor:
    """Random rows where token `favoured[i]` of row i dominates (the choice of any sampler)."""
    torch.manual_seed(0)
    logits = torch.randn(rows, VOCAB)
    for i, t in enumerate(favoured):
        logits[i, t] = 12.0
    return logits


def test_greedy_picks_best_non_banned_token():
    logits = _logits(3, [5, 9, 7])
    params = [SamplingParams(temperature=0)] * 3
    banned = [[5], [], [7, 3, 5]]
    before = logits.clone()
    out = sample(logits, params, [None] * 3, banned)
    want0 = int(logits[0].masked_fill(torch.arange(VOCAB) == 5, float("-inf")).argmax())
    want2 = int(
        logits[2]
        .masked_fill(torch.isin(torch.arange(VOCAB), torch.tensor([7, 3, 5])), float("-inf"))
        .argmax()
    )
    assert out.token_ids == [want0, 9, want2]
    assert 5 != want0 and want2 not in (7, 3, 5)
    # logprobs are log_softmax of the raw logits, and the caller's logits are untouched
    assert torch.equal(out.logprobs, torch.log_softmax(before, dim=-1))
    assert torch.equal(logits, before)
    # nothing banned: exactly the unmasked sampler
    assert sample(logits, params, [None] * 3, [[], [], []]).token_ids == [5, 9, 7]


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.9)],
)
def test_seeded_sampling_never_picks_banned(settings):
    rows = 8
    logits = _logits(rows, [4] * rows)
    logits[:, 11] = 11.5  # a second banned token, also dominant
    banned = [[4, 11]] * (rows - 1) + [[]]  # the last row has nothing banned
    params = [SamplingParams(seed=i, **settings) for i in range(rows)]
    for step in range(20):
        gens = [torch.Generator().manual_seed(1000 * step + i) for i in range(rows)]
        ref_gens = [torch.Generator().manual_seed(1000 * step + i) for i in range(rows)]
        out = sample(logits, params, gens, banned)
        assert all(t not in (4, 11) for t in out.token_ids[:-1])
        # each row is the reference algorithm on its masked row, with the same single draw
        for i in range(rows):
            row = logits[i].clone()
            row[banned[i]] = float("-inf")
            assert out.token_ids[i] == reference_sample(row, SamplingSettings(**settings), ref_gens[i])
            assert torch.equal(gens[i].get_state(), ref_gens[i].get_state())
        assert torch.equal(out.logprobs, torch.log_softmax(logits, dim=-1))
    # without the mask the dominant banned tokens are what gets sampled
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    assert all(t in (4, 11) for t in sample(logits, params, gens).token_ids)


def test_banned_ids_helper():
    eos = {2, 3}

    def req(n_out, **kw):
        r = Request("r", [1, 5, 6], SamplingParams(max_tokens=10, **kw), None)
        for _ in range(n_out):
            r.append_output_token_ids(7)
        return r

    assert min_tokens_banned_ids(req(0, min_tokens=2, stop_token_ids=[9]), eos) == [2, 3, 9]
    assert min_tokens_banned_ids(req(1, min_tokens=2, stop_token_ids=[9], ignore_eos=True), eos) == [9]
    assert min_tokens_banned_ids(req(2, min_tokens=2, stop_token_ids=[9]), eos) == []
    assert min_tokens_banned_ids(req(0, stop_token_ids=[9]), eos) == []


def _first_greedy_token(tiny) -> tuple[list[int], int]:
    cfg, state, _ = tiny(num_hidden_layers=2)
    prompt = random_prompts(1, cfg.vocab_size, [11], seed=3)[0]
    out = LLM.from_state_dict(cfg, state).generate(
        prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False
    )
    return prompt, out[0].outputs[0].token_ids[0]


def _gen(llm, prompt, **kw):
    kw = {"max_tokens": 8, "logprobs": 0, **kw}
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def test_stop_token_id_not_sampled_before_min_tokens(tiny):
    prompt, t = _first_greedy_token(tiny)
    cfg, state, _ = tiny(num_hidden_layers=2)
    llm = LLM.from_state_dict(cfg, state)
    # without min_tokens the greedy first token is the stop token: stop at once
    o = _gen(llm, prompt, temperature=0, stop_token_ids=[t])
    assert (o.token_ids, o.finish_reason, o.stop_reason) == ([t], "stop", t)
    # with min_tokens=3 it is never produced among the first 3 outputs
    o = _gen(llm, prompt, temperature=0, stop_token_ids=[t], min_tokens=3)
    assert len(o.token_ids) >= 3 and t not in o.token_ids[:3]
    if t in o.token_ids:  # after min_tokens the stop token stops the request again
        assert o.token_ids[-1] == t and o.finish_reason == "stop"
    # seeded sampling masks too
    for seed in range(5):
        o = _gen(llm, prompt, temperature=1.0, seed=seed, stop_token_ids=[t], min_tokens=3)
        assert len(o.token_ids) >= 3 and t not in o.token_ids[:3]


def test_eos_not_sampled_before_min_tokens_unless_ignore_eos(tiny):
    prompt, t = _first_greedy_token(tiny)
    cfg, state, _ = tiny(num_hidden_layers=2, eos_token_id=[t])  # same weights, EOS = the greedy token
    llm = LLM.from_state_dict(cfg, state)
    o = _gen(llm, prompt, temperature=0)
    assert (o.token_ids, o.finish_reason, o.stop_reason) == ([t], "stop", None)
    masked = _gen(llm, prompt, temperature=0, min_tokens=3)
    assert len(masked.token_ids) >= 3 and t not in masked.token_ids[:3]
    # the reported logprobs are the raw ones: the chosen token's is below the (masked) EOS's
    ignored = _gen(llm, prompt, temperature=0, max_tokens=1, ignore_eos=True, logprobs=1)
    raw_eos_logprob = ignored.logprobs[0][t]
    assert masked.logprobs[0][masked.token_ids[0]] < raw_eos_logprob
    # ignore_eos: EOS is not banned (nor stopping), so min_tokens changes nothing
    o = _gen(llm, prompt, temperature=0, min_tokens=3, ignore_eos=True)
    assert o.token_ids[0] == t and len(o.token_ids) == 8 and o.finish_reason == "length"
    # ignore_eos with a stop token: the stop token is still banned before min_tokens
    o = _gen(llm, prompt, temperature=0, min_tokens=3, ignore_eos=True, stop_token_ids=[t])
    assert len(o.token_ids) >= 3 and t not in o.token_ids[:3]
    # a batch mixing masked and unmasked requests: each is as when run alone
    outs = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(temperature=0, max_tokens=8),
            SamplingParams(temperature=0, max_tokens=8, min_tokens=3),
        ],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids == [t]
    assert outs[1].outputs[0].token_ids == masked.token_ids


# ---- stop strings and min_tokens (vLLM's detokenizer rule) ---------------------------------------


def _stop_run(text: str, **kw) -> tuple[str, str, str | None, str | int | None]:
    """Feed `text` one character (token) at a time through check_stop until it stops.
    -> (text of the kept token ids, output_text, finish_reason, stop_reason)."""
    tok = CharTokenizer()
    req = Request("r", [1], SamplingParams(max_tokens=len(text), ignore_eos=True, **kw), None)
    for t in tok.encode(text):
        req.append_output_token_ids(t)
        if check_stop(req, t, set(), 10_000, tok.decode):
            break
    return tok.decode(req.output_token_ids), req.output_text, req.finish_reason, req.stop_reason


@pytest.mark.parametrize(
    "text,kw,want",
    [
        ("a.bc.d", dict(stop=".", min_tokens=3), ("a.bc.", "a.bc", "stop", ".")),  # the first "." is early
        ("a.bc.d", dict(stop="."), ("a.", "a", "stop", ".")),
        ("a.bcde", dict(stop=".", min_tokens=2), ("a.bcde", "", "length", None)),  # "." is output 2 of 2
        ("a.bcd", dict(stop="bc", min_tokens=3), ("a.bc", "a.", "stop", "bc")),  # straddles: it ends later
        ("abab.", dict(stop="ab", min_tokens=2), ("abab", "ab", "stop", "ab")),
        ("abcd", dict(stop=["ab", "d"], min_tokens=2), ("abcd", "abc", "stop", "d")),
    ],
)
def test_stop_string_counts_only_if_it_ends_after_min_tokens(text, kw, want):
    ids_text, out_text, reason, stop_reason = _stop_run(text, **kw)
    assert (ids_text, out_text, reason, stop_reason) == want
    if reason == "stop":  # text and token ids agree: the ids' text, cut before the stop string
        assert ids_text == out_text + stop_reason


def test_stop_string_before_min_tokens_does_not_cut_the_text(tiny):
    """Engine, greedy: a "." is generated at output 2 and again later; with min_tokens=8 the text is
    every kept token's text up to the first "." generated after output 8 (it used to be cut at the
    early ".", while 8 tokens were kept)."""
    cfg, state, _ = tiny(num_hidden_layers=2)
    prompt = random_prompts(1, cfg.vocab_size, [11], seed=3)[0]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    toks = LLM.from_state_dict(cfg, state).generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids
    dots = {toks[1], toks[9]}
    tok = CharTokenizer({t: "." if t in dots else "x" for t in range(cfg.vocab_size)})
    llm = LLM.from_state_dict(cfg, state, tokenizer=tok)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, min_tokens=8, stop=["."])
    o = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    j = next(i for i in range(8, 16) if toks[i] in dots)
    assert (o.finish_reason, o.stop_reason) == ("stop", ".")
    assert o.token_ids == toks[: j + 1]
    assert o.text == tok.decode(toks[:j]) and "." in o.text[:2]
    # without min_tokens the early "." stops it
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=["."]), use_tqdm=False)
    first = next(i for i, t in enumerate(toks) if t in dots)
    assert (o[0].outputs[0].token_ids, o[0].outputs[0].text) == (toks[: first + 1], tok.decode(toks[:first]))
