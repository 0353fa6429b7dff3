"""The demo's calibrated student (SwiftKV at L = 15 of the embedded model, cached after its first
calibration) answers the capital-of-France question in fp32 and in bf16, like the model it came from."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("swiftkv_distill") is None,
    reason="needs swiftkv-distill (the demo's calibration)",
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_student_says_paris(dtype):
    from swiftkv_fast import LLM, SamplingParams

    from bench.demo import calibrated_student

    path, _, _ = calibrated_student(15, seed=0)
    llm = LLM(str(path), dtype=dtype, max_model_len=512, kv_cache_memory=32 << 20)
    assert llm.get_kernel_plan()["dtype"] == dtype
    text = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert "Paris" in text, text
