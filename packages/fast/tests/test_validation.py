"""Bad input, as a hostile user would try it, on LLM(...), SamplingParams, generate and chat: each is a
TypeError (wrong type) or ValueError (wrong value) raised before any work, naming the request (or
conversation and message) and the field, and the call adds nothing: the engine has no request, every
KV block is free, and the next call gives the same tokens as before."""

from __future__ import annotations

import math

import pytest
import torch
from char_tokenizer import CharTokenizer
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.config import EngineConfig, device_memory_bytes

GOOD = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
VOCAB = 128  # the tiny models'


@pytest.fixture(scope="module")
def llm(tiny):
    cfg, state, _ = tiny(model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2)
    return LLM.from_state_dict(
        cfg, state, tokenizer=CharTokenizer(), block_size=8, max_model_len=256, num_kv_blocks=200
    )


@pytest.fixture(scope="module")
def baseline(llm):
    return _tokens(llm.generate([[4, 5, 6], [7, 8]], GOOD, use_tqdm=False))


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_nothing_added(llm, baseline):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.kv_manager.num_requests == 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks - 1  # all but the null block
    assert _tokens(llm.generate([[4, 5, 6], [7, 8]], GOOD, use_tqdm=False)) == baseline


def _params(**changes) -> SamplingParams:
    """Valid params, then fields reassigned (bypassing __post_init__) to reach generate's own check."""
    p = SamplingParams(temperature=0, max_tokens=4)
    for k, v in changes.items():
        setattr(p, k, v)
    return p


BAD_PROMPTS = [
    ([], ValueError, r"request 1: prompt is empty"),
    ([5] * 257, ValueError, r"request 1: prompt has 257 tokens.*max_model_len=256"),
    ([5, 128], ValueError, r"request 1: prompt_token_ids \[128\] are outside the vocabulary \[0, 128\)"),
    ([5, -1], ValueError, r"request 1: prompt_token_ids \[-1\]"),
    ([1.0, 2.0], TypeError, r"request 1: prompt_token_ids\[0\] must be an int, got float 1\.0"),
    ([1, "a"], TypeError, r"request 1: prompt_token_ids\[1\] must be an int, got str 'a'"),
    ([1, True], TypeError, r"request 1: prompt_token_ids\[1\] must be an int, got bool True"),
    (None, TypeError, r"request 1: prompt must be a str, a list of token ids .*got NoneType None"),
    (5, TypeError, r"request 1: prompt must be .*got int 5"),
    (b"abc", TypeError, r"request 1: prompt must be .*got bytes"),
    (torch.tensor([1.0, 2.0]), TypeError, r"request 1: prompt_token_ids must be an integer tensor.*float32"),
    (torch.tensor([[1, 2]]), ValueError, r"request 1: prompt_token_ids must be a 1-D tensor.*\(1, 2\)"),
    (torch.tensor([1, 200]), ValueError, r"request 1: prompt_token_ids \[200\] are outside the vocabulary"),
    ({"prompt_tokens": [1]}, ValueError, r"request 1: unknown prompt keys 'prompt_tokens'"),
    ({"prompt_token_ids": "abc"}, TypeError, r"request 1: prompt_token_ids must be a list of int"),
    ({"prompt_token_ids": [1, 2.5]}, TypeError, r"request 1: prompt_token_ids\[1\] must be an int"),
    ({"prompt": 5}, TypeError, r"request 1: prompt must be a str, got int 5"),
    ({}, ValueError, r"request 1: a dict prompt needs 'prompt' or 'prompt_token_ids'"),
    ("", ValueError, r"request 1: prompt is empty"),
]

BAD_PARAMS = [
    (_params(temperature=-0.5), ValueError, r"sampling_params\.temperature must be >= 0"),
    (_params(top_p=0.0), ValueError, r"sampling_params\.top_p must be in \(0, 1\], got 0\.0"),
    (_params(top_p=1.5), ValueError, r"sampling_params\.top_p must be in \(0, 1\], got 1\.5"),
    (_params(max_tokens=0), ValueError, r"sampling_params\.max_tokens must be an int >= 1"),
    (_params(temperature="0.5"), TypeError,
     r"sampling_params\.temperature must be a real number, got str '0\.5'"),
    (_params(temperature=math.inf), ValueError, r"sampling_params\.temperature must be finite, got inf"),
    (_params(temperature=math.nan), ValueError, r"sampling_params\.temperature must be finite, got nan"),
    (_params(temperature=1e-40), ValueError,
     r"sampling_params\.temperature must be 0 \(greedy\) or in \[1e-30, 1e\+30\], got 1e-40"),
    (_params(temperature=10**400), ValueError, r"sampling_params\.temperature must be finite"),
    (_params(temperature=1e39), ValueError, r"sampling_params\.temperature must be 0 \(greedy\) or in"),
    (_params(temperature=True), TypeError, r"sampling_params\.temperature must be a real number, got bool"),
    (_params(top_p=math.nan), ValueError, r"sampling_params\.top_p must be finite"),
    (_params(top_p=None), TypeError, r"sampling_params\.top_p must be a real number, got NoneType"),
    (_params(top_k=-2), ValueError, r"sampling_params\.top_k must be -1 or 0 \(off\) or a positive int"),
    (_params(top_k=2.5), TypeError, r"sampling_params\.top_k must be an int, got float 2\.5"),
    (_params(max_tokens=True), TypeError, r"sampling_params\.max_tokens must be an int, got bool True"),
    (_params(max_tokens=4.0), TypeError, r"sampling_params\.max_tokens must be an int, got float 4\.0"),
    (_params(min_tokens=-1), ValueError, r"sampling_params\.min_tokens must be in \[0, max_tokens=4\]"),
    (_params(min_tokens=5), ValueError, r"sampling_params\.min_tokens must be in \[0, max_tokens=4\]"),
    (_params(stop_token_ids=5), TypeError, r"sampling_params\.stop_token_ids must be a list of int, got int"),
    (_params(stop_token_ids=[True]), TypeError, r"sampling_params\.stop_token_ids\[0\] must be an int"),
    (_params(stop_token_ids=[-1]), ValueError, r"sampling_params\.stop_token_ids\[0\] must be >= 0"),
    (_params(stop_token_ids=[3, 500]), ValueError, r"sampling_params\.stop_token_ids \[500\] are outside"),
    (_params(stop=5), TypeError, r"sampling_params\.stop must be a str or a list of str, got int 5"),
    (_params(stop=[".", 5]), TypeError, r"sampling_params\.stop\[1\] must be a str, got int 5"),
    (_params(stop=[""]), ValueError, r"sampling_params\.stop\[0\] must not be empty"),
    (_params(seed=2**64), ValueError, r"sampling_params\.seed must be in \[-2\*\*63, 2\*\*64\)"),
    (_params(seed=-(2**63) - 1), ValueError, r"sampling_params\.seed must be in"),
    (_params(seed="1"), TypeError, r"sampling_params\.seed must be an int or None, got str '1'"),
    (_params(logprobs=VOCAB + 1), ValueError, r"sampling_params\.logprobs: requested sample logprobs of 129, "
     r"which is greater than max allowed: 128"),
    (_params(logprobs=True), TypeError, r"sampling_params\.logprobs must be an int or None, got bool"),
    (_params(ignore_eos="no"), TypeError, r"sampling_params\.ignore_eos must be a bool, got str 'no'"),
    ({"temperature": 0}, TypeError, r"sampling_params must be a SamplingParams, got dict"),
]  # fmt: skip


@pytest.mark.parametrize(
    "prompt,params,exc,match",
    [(p, GOOD, e, m) for p, e, m in BAD_PROMPTS] + [([5], p, e, "request 1: " + m) for p, e, m in BAD_PARAMS],
)
def test_bad_request_names_request_and_field_and_adds_nothing(llm, baseline, prompt, params, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate([[1, 2, 3], prompt], [GOOD, params], use_tqdm=False)
    _assert_nothing_added(llm, baseline)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda llm: llm.generate([[1], [2]], [GOOD]), ValueError, r"2 prompts but 1 sampling_params"),
        (lambda llm: llm.generate([[1]], {"temperature": 0}), TypeError, r"sampling_params must be a Sampl"),
        (lambda llm: llm.generate([1.0, 2.0], GOOD), TypeError, r"request 0: prompt_token_ids\[0\] must be"),
        (lambda llm: llm.generate([1, "a"], GOOD), TypeError, r"request 0: prompt_token_ids\[1\] must be"),
        (lambda llm: llm.generate(None, GOOD), TypeError, r"request 0: prompt must be"),
    ],
)
def test_bad_call_shape(llm, baseline, call, exc, match):
    with pytest.raises(exc, match=match):
        call(llm)
    _assert_nothing_added(llm, baseline)


def test_seed_out_of_range_fails_in_validation_and_queues_nothing(llm, baseline):
    # 2**64 used to pass validation, then fail in add_request with the batch's earlier requests queued
    long = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with pytest.raises(ValueError, match=r"request 2: sampling_params\.seed"):
        llm.generate([[1, 2], [3, 4], [5, 6]], [long, long, _params(seed=2**64)], use_tqdm=False)
    _assert_nothing_added(llm, baseline)


def test_accepted_inputs(llm, baseline):
    # a 1-D integer tensor (any int dtype), a dict with both text and ids, the seed range's ends
    ids = [4, 5, 6]
    for prompt in (torch.tensor(ids), torch.tensor(ids, dtype=torch.int32), {"prompt_token_ids": ids}):
        assert _tokens(llm.generate(prompt, GOOD, use_tqdm=False)) == baseline[:1]
    assert _tokens(llm.generate(torch.tensor([ids, [7, 8, 9]]), GOOD, use_tqdm=False))[0] == baseline[0]
    out = llm.generate({"prompt": "efg", "prompt_token_ids": ids}, GOOD, use_tqdm=False)[0]
    assert out.prompt == "efg" and out.prompt_token_ids == ids
    for seed in (-(2**63), -1, 2**64 - 1):
        out = llm.generate(ids, SamplingParams(seed=seed, max_tokens=3), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 3
    lp = llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, logprobs=VOCAB), use_tqdm=False)
    assert len(lp[0].outputs[0].logprobs[0]) == VOCAB


def test_numpy_numbers_are_accepted_as_python_ones(llm, baseline):
    np = pytest.importorskip("numpy")
    out = llm.generate(np.array([4, 5, 6]), GOOD, use_tqdm=False)
    assert _tokens(out) == baseline[:1] and type(out[0].prompt_token_ids[0]) is int
    p = SamplingParams(
        temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint64(2**64 - 1), logprobs=np.int8(2)
    )
    assert [type(v) for v in (p.temperature, p.top_k, p.seed, p.logprobs)] == [float, int, int, int]
    assert len(llm.generate([4, 5, 6], p, use_tqdm=False)[0].outputs[0].logprobs[0]) >= 2


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(temperature="0.5"), TypeError, r"^temperature must be a real number, got str '0\.5'"),
        (dict(temperature=-1), ValueError, r"^temperature must be >= 0"),
        (dict(top_p=0), ValueError, r"^top_p must be in \(0, 1\]"),
        (dict(max_tokens=0), ValueError, r"^max_tokens must be an int >= 1"),
        (dict(top_k=-2), ValueError, r"^top_k must be -1 or 0"),
        (dict(min_tokens=20), ValueError, r"^min_tokens must be in \[0, max_tokens=16\]"),
        (dict(temperature=math.inf), ValueError, r"^temperature must be finite"),
        (dict(top_p=math.nan), ValueError, r"^top_p must be finite"),
        (dict(stop_token_ids=5), TypeError, r"^stop_token_ids must be a list of int"),
        (dict(stop=[1]), TypeError, r"^stop\[0\] must be a str"),
        (dict(max_tokens=False), TypeError, r"^max_tokens must be an int, got bool"),
        (dict(seed=2**64), ValueError, r"^seed must be in"),
        (dict(logprobs=-1), ValueError, r"^logprobs must be None or an int >= 0"),
    ],
)
def test_sampling_params_checks_on_construction(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalizes_stop():
    p = SamplingParams(stop=".", stop_token_ids=(3, 4))
    assert p.stop == ["."] and p.stop_token_ids == [3, 4]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"] and SamplingParams().stop == []


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("hello", GOOD, r"request 1: a text prompt needs a tokenizer"),
        ([5], SamplingParams(stop=["x"]), r"request 1: sampling_params\.stop needs a tokenizer"),
        ({"prompt": "hello"}, GOOD, r"request 1: a text prompt needs a tokenizer"),
    ],
)
def test_text_needs_a_tokenizer(tiny, prompt, params, match):
    cfg, state, _ = tiny(num_hidden_layers=2)
    llm = LLM.from_state_dict(cfg, state, max_model_len=64, num_kv_blocks=32)
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2], prompt], [GOOD, params], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"chat needs a tokenizer"):
        llm.chat("hello", use_tqdm=False)


# ---- chat ---------------------------------------------------------------------------------------

USER = {"role": "user", "content": "hi"}


def test_chat_string_is_one_user_message(llm):
    tok = llm.tokenizer
    outs = llm.chat("hello", GOOD, use_tqdm=False)  # once: five conversations, one per character
    assert len(outs) == 1
    assert outs[0].prompt_token_ids == tok.apply_chat_template([{"role": "user", "content": "hello"}])
    outs = llm.chat(["hello", [USER]], GOOD, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        tok.apply_chat_template([{"role": "user", "content": "hello"}]),
        tok.apply_chat_template([USER]),
    ]


@pytest.mark.parametrize(
    "messages,exc,match",
    [
        ([{"role": "user"}], ValueError, r"conversation 0, message 0 has no 'content'"),
        ([[USER], [USER, {"content": "x"}]], ValueError, r"conversation 1, message 1 has no 'role'"),
        ([[USER, "hi"]], TypeError, r"conversation 0, message 1 must be a dict .*got str 'hi'"),
        ([{"role": "user", "content": None}], TypeError, r"conversation 0, message 0: content must be a str"),
        ([{"role": 1, "content": "x"}], TypeError, r"conversation 0, message 0: role must be a str, got int"),
        ([[USER], []], ValueError, r"conversation 1 is empty"),
        ([[USER], 5], TypeError, r"conversation 1 must be a str or a list of message dicts, got int 5"),
        (5, TypeError, r"chat messages must be a str, a list of"),
        ([[USER], [{"role": "robot", "content": "x"}]], ValueError, r"conversation 1: applying .*robot"),
    ],
)
def test_bad_chat_names_conversation_and_message(llm, baseline, messages, exc, match):
    with pytest.raises(exc, match=match):
        llm.chat(messages, GOOD, use_tqdm=False)
    _assert_nothing_added(llm, baseline)


# ---- engine configuration -------------------------------------------------------------------------

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        pytest.param(
            dict(device="cuda"), ValueError, r"device='cuda', but this machine has no CUDA",
            marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available"),
        ),
        (dict(device=f"cuda:{torch.cuda.device_count()}"), ValueError, r"device='cuda:\d+', but this"),
        (dict(device="mps"), ValueError, r"device must be 'auto', 'cpu' or 'cuda\[:N\]', got 'mps'"),
        (dict(device="gpu"), ValueError, r"device must be 'auto', 'cpu' or 'cuda\[:N\]', got 'gpu'"),
        (dict(device=0), TypeError, r"device must be"),
        (dict(dtype=torch.int8), ValueError, r"dtype must be .*got torch\.int8"),
        (dict(dtype=torch.float64), ValueError, r"dtype must be .*got torch\.float64"),
        (dict(dtype="int8"), ValueError, r"dtype must be 'auto' or one of"),
        (dict(kv_cache_memory=10**15), ValueError, r"kv_cache_memory needs 10{15} bytes .* more than"),
        (dict(kv_cache_memory=True), ValueError, r"kv_cache_memory must be None or a positive int"),
        (dict(block_size=True), ValueError, r"block_size must be a positive int, got True"),
        (dict(max_num_seqs=2.0), ValueError, r"max_num_seqs must be a positive int"),
        (dict(enable_prefix_caching="no"), TypeError, r"enable_prefix_caching must be a bool, got 'no'"),
        (dict(seed=1.5), TypeError, r"seed must be an int, got 1\.5"),
        (dict(model=123), TypeError, r"model must be a checkpoint directory path or None"),
        pytest.param(
            dict(attention_backend="flash_attn", block_size=256), ValueError, r"flash_attn' needs a CUDA",
            marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available"),
        ),
    ],
)  # fmt: skip
def test_engine_config_errors_before_loading_weights(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LLM(**{"model": "/nonexistent/checkpoint", **kwargs})  # loading it would be another error


@pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")
def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"attention_backend='triton' on CPU needs TRITON_INTERPRET=1"):
        EngineConfig(attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(attention_backend="triton").attention_backend == "triton"


def test_engine_config_accepts_and_resolves():
    e = EngineConfig(dtype="bf16", device="cpu")
    assert (e.dtype, e.device) == (torch.bfloat16, "cpu")
    assert EngineConfig(dtype=torch.float16, device=torch.device("cpu")).device == "cpu"
    assert EngineConfig(kv_cache_memory=1 << 20).kv_cache_memory == 1 << 20
    assert device_memory_bytes("cpu") > 1 << 20


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(attention_backend="nope"), r"attention_backend must be one of"),
        (dict(num_kv_blocks=4), r"cannot hold one request"),
        (dict(num_kv_blocks=1), r"num_kv_blocks must be >= 2"),
        (dict(max_model_len=100000), r"max_model_len=100000 exceeds the model's max_position_embeddings"),
    ],
)
def test_engine_config_errors_against_the_model(tiny, kwargs, match):
    cfg, state, _ = tiny(num_hidden_layers=2)
    with pytest.raises(ValueError, match=match):
        LLM.from_state_dict(cfg, state, **kwargs)


def test_num_kv_blocks_beyond_memory_fails_before_allocation(tiny):
    cfg, state, _ = tiny(num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"num_kv_blocks=10{13} \(\d+ bytes each\) needs .* more than"):
        LLM.from_state_dict(cfg, state, num_kv_blocks=10**13)
