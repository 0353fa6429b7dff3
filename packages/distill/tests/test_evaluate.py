"""`evaluate`: the teacher against itself is perfect agreement; a SwiftKV student is not; every figure
equals a brute-force per-example computation with the reference; greedy decoding agrees between the
fast engine and the reference fallback."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from swiftkv_distill.data import Example
from swiftkv_distill.evaluate import EvalResult, evaluate, greedy_continuations
from swiftkv_reference.checkpoint import swiftkv_init
from swiftkv_reference.model import SwiftKVForCausalLM
from swiftkv_reference.testing import random_state_dict, tiny_config, tiny_model
from tiny_models import PLAIN_MODELS


def _model(config, state) -> SwiftKVForCausalLM:
    model = SwiftKVForCausalLM(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


def _pair(name: str = "llama", num_key_value_layers: int = 2, key_value_group_size: int = 1):
    """(teacher, student): a plain tiny model and its SwiftKV student with Snowflake's init."""
    config = tiny_config(**PLAIN_MODELS[name])
    state = random_state_dict(config, seed=0)
    student_config, student_state = swiftkv_init(config, state, num_key_value_layers, key_value_group_size)
    return _model(config, state), _model(student_config, student_state)


def _heldout(vocab: int, num: int = 7, seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        n = int(torch.randint(4, 20, (1,), generator=g))
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append(Example(ids, int(torch.randint(1, n, (1,), generator=g)), key=str(i)))
    return out


def test_teacher_against_itself_agrees_perfectly():
    teacher, _ = _pair()
    heldout = _heldout(teacher.config.vocab_size)
    r = evaluate(teacher, teacher, heldout, greedy_tokens=8, batch_tokens=40)
    assert r.top1_agreement == 1.0 and r.kl == 0.0 and r.greedy_agreement == 1.0
    assert r.teacher_perplexity == r.student_perplexity > 1
    assert r.num_examples == 7 and r.num_greedy_prompts == 7
    assert r.num_answer_tokens == sum(len(e.answer_token_ids) for e in heldout)
    assert (r.num_key_value_layers, r.num_hidden_layers) == (4, 4)


@pytest.mark.parametrize("name, big_l, g", [("llama", 2, 1), ("qwen2_hybrid_bias", 2, 2)])
def test_evaluate_equals_a_brute_force_reference_computation(name, big_l, g):
    teacher, student = _pair(name, big_l, g)
    heldout = _heldout(teacher.config.vocab_size, num=6, seed=1)
    r = evaluate(teacher, student, heldout, greedy_tokens=0, batch_tokens=40)  # several padded batches
    agree = kl = t_nll = s_nll = 0.0
    n = 0
    for e in heldout:
        ids = torch.tensor(e.token_ids)
        positions = list(range(e.answer_start - 1, len(e) - 1))
        t = torch.log_softmax(teacher.forward(ids, positions, swiftkv=False).double(), -1)  # (P, V)
        s = torch.log_softmax(student.forward(ids, positions, swiftkv=True).double(), -1)
        targets = ids[e.answer_start :]
        for p in range(len(positions)):
            agree += float(t[p].argmax() == s[p].argmax())
            kl += float((t[p].exp() * (t[p] - s[p])).sum())
            t_nll -= float(t[p, targets[p]])
            s_nll -= float(s[p, targets[p]])
            n += 1
    assert r.num_answer_tokens == n and r.num_examples == 6
    assert r.top1_agreement == pytest.approx(agree / n, abs=1e-12)
    assert r.kl == pytest.approx(kl / n, rel=1e-4)
    assert r.teacher_perplexity == pytest.approx(math.exp(t_nll / n), rel=1e-5)
    assert r.student_perplexity == pytest.approx(math.exp(s_nll / n), rel=1e-5)
    assert r.top1_agreement < 1 and r.kl > 0.01 and r.greedy_agreement is None
    assert (r.num_key_value_layers, r.key_value_group_size) == (big_l, g)


def test_a_swiftkv_student_disagrees_greedily_and_fast_matches_the_reference(monkeypatch):
    teacher, student = _pair()
    heldout = _heldout(teacher.config.vocab_size, num=5, seed=2)
    heldout.append(Example(heldout[0].token_ids, heldout[0].answer_start, key="same prompt, other sample"))
    r = evaluate(teacher, student, heldout, greedy_tokens=8)
    assert r.num_greedy_prompts == 5  # distinct prompts
    assert r.greedy_agreement < 1
    prompts = [e.prompt_token_ids for e in heldout[:5]]
    fast = [greedy_continuations(m, prompts, 8) for m in (teacher, student)]
    monkeypatch.setitem(sys.modules, "swiftkv_fast", None)  # not installed: the reference decodes
    reference = [greedy_continuations(m, prompts, 8) for m in (teacher, student)]
    assert fast == reference
    assert r.greedy_agreement == sum(a == b for a, b in zip(*reference)) / 5


def test_llm_factory_builds_the_greedy_engines():
    from swiftkv_fast import LLM

    teacher, student = _pair()
    built = []

    def factory(config, state):
        built.append(config.num_key_value_layers)
        return LLM.from_state_dict(config, state, block_size=8, max_model_len=64)

    heldout = _heldout(teacher.config.vocab_size, num=3)
    r = evaluate(teacher, student, heldout, llm_factory=factory, greedy_tokens=4)
    assert built == [4, 2] and r.num_greedy_prompts == 3


def test_evaluate_restores_training_mode_and_touches_no_weight():
    teacher, student = _pair()
    student.train()
    before = {k: v.clone() for k, v in student.state_dict().items()}
    evaluate(teacher, student, _heldout(teacher.config.vocab_size, num=2), greedy_tokens=0)
    assert student.training and not teacher.training
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())


def test_evaluate_refuses_bad_input():
    teacher, student = _pair()
    heldout = _heldout(teacher.config.vocab_size, num=2)
    with pytest.raises(ValueError, match="the teacher must be the plain model"):
        evaluate(student, student, heldout)
    with pytest.raises(ValueError, match="vocabularies differ: 128 vs 96"):
        evaluate(teacher, tiny_model(tiny_config(vocab_size=96)), heldout)
    with pytest.raises(ValueError, match="no held-out examples"):
        evaluate(teacher, student, [])
    with pytest.raises(ValueError, match="greedy_tokens must be an int >= 0"):
        evaluate(teacher, student, heldout, greedy_tokens=-1)
    with pytest.raises(ValueError, match="token id 500 >= vocab_size 128"):
        evaluate(teacher, student, [Example([1, 500], 1)])


def _result(**changes) -> EvalResult:
    values = dict(
        num_examples=3,
        num_answer_tokens=40,
        top1_agreement=0.75,
        kl=0.3,
        teacher_perplexity=4.0,
        student_perplexity=5.5,
        greedy_agreement=0.5,
        num_greedy_prompts=2,
        greedy_tokens=32,
        num_hidden_layers=30,
        num_key_value_layers=15,
        key_value_group_size=1,
    )
    return EvalResult(**{**values, **changes})


def test_eval_result_round_trips_and_validates_itself():
    import json

    r = _result()
    assert EvalResult.from_dict(json.loads(r.to_json())) == r
    with pytest.raises(ValueError, match="top1_agreement must be in"):
        _result(top1_agreement=1.5)
    with pytest.raises(ValueError, match="kl must be >= 0"):
        _result(kl=float("nan"))
    with pytest.raises(ValueError, match="student_perplexity must be >= 1"):
        _result(student_perplexity=0.5)
    with pytest.raises(ValueError, match="greedy_agreement is None exactly when greedy_tokens == 0"):
        _result(greedy_agreement=None)
    with pytest.raises(ValueError, match=r"missing \['kl'\], unknown \['extra'\]"):
        EvalResult.from_dict({**{k: v for k, v in r.to_dict().items() if k != "kl"}, "extra": 1})


def test_pooled_results_weigh_tokens_and_greedy_prompts():
    a = _result(
        num_answer_tokens=30,
        top1_agreement=0.6,
        kl=0.4,
        student_perplexity=4.0,
        num_greedy_prompts=1,
        greedy_agreement=1.0,
    )
    b = _result(
        num_answer_tokens=10,
        top1_agreement=1.0,
        kl=0.0,
        student_perplexity=16.0,
        num_greedy_prompts=3,
        greedy_agreement=0.0,
        num_examples=5,
    )
    p = EvalResult.pooled([a, b])
    assert p.num_examples == 8 and p.num_answer_tokens == 40 and p.num_greedy_prompts == 4
    assert p.top1_agreement == pytest.approx(0.7) and p.kl == pytest.approx(0.3)
    assert p.student_perplexity == pytest.approx(math.exp((30 * math.log(4) + 10 * math.log(16)) / 40))
    assert p.teacher_perplexity == pytest.approx(4.0) and p.greedy_agreement == pytest.approx(0.25)
    assert EvalResult.pooled([a]) == a
    no_greedy = dict(greedy_tokens=0, greedy_agreement=None, num_greedy_prompts=0)
    assert EvalResult.pooled([_result(**no_greedy)] * 2).greedy_agreement is None
    with pytest.raises(ValueError, match="nothing to pool"):
        EvalResult.pooled([])
    with pytest.raises(ValueError, match="one student shape"):
        EvalResult.pooled([a, _result(num_key_value_layers=20)])
    with pytest.raises(ValueError, match="same number of greedy tokens"):
        EvalResult.pooled([a, _result(**no_greedy)])
