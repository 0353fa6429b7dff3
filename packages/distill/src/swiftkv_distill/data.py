"""Distillation data: `Example`s (token ids + where the answer starts) written by the teacher from the
built-in prompt set or read from the user's JSONL, the held-out split, and packing into `Batch`es.

    prompts = builtin_prompts()                     # ~1,500 short instructions (prompts.txt)
    examples = generate_teacher_data(llm, prompts, num_samples=200, max_tokens=256, temperature=0.7, seed=0)
    examples = load_jsonl("data.jsonl", tokenizer)  # {"messages": [...]} or {"text": "..."} per line
    train, heldout = split_holdout(examples, share=0.1, seed=0)
    for batch in batches(train, batch_tokens=4096, pad_token_id=0): ...

The held-out split hashes each example's `key` (the prompt's text), so it does not depend on the order
of the examples, all samples of one prompt fall on the same side, and adding examples moves no other
example across the split.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from swiftkv_reference.tokenizer import chat_token_ids

from .batch import Batch

logger = logging.getLogger(__name__)

DEFAULT_HOLDOUT_SHARE = 0.1
DEFAULT_MAX_TOKENS = 256
# teacher answers the built-in prompts get by default: about where calibration's held-out agreement on
# the embedded model levels off (docs/distill.md)
DEFAULT_NUM_SAMPLES = 1024
DEFAULT_TEMPERATURE = 0.7


@dataclass(frozen=True)
class Example:
    """One training sequence: prompt tokens then answer tokens (token_ids[answer_start:]).
    key: the prompt's identity for the held-out split (None: the prompt's token ids)."""

    token_ids: tuple[int, ...]
    answer_start: int  # 1 <= answer_start < len(token_ids): at least one prompt and one answer token
    key: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if not 1 <= self.answer_start < len(self.token_ids):
            raise ValueError(
                f"answer_start must be in [1, {len(self.token_ids)}) (a prompt token and an answer token), "
                f"got {self.answer_start} for {len(self.token_ids)} tokens"
            )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[: self.answer_start]

    @property
    def answer_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[self.answer_start :]

    @property
    def holdout_key(self) -> str:
        return self.key if self.key is not None else ",".join(map(str, self.prompt_token_ids))


def builtin_prompts() -> list[str]:
    """The built-in prompt set (package data prompts.txt): one instruction per non-blank line."""
    text = resources.files(__package__).joinpath("prompts.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def builtin_prompts_fingerprint() -> str:
    """sha256 of the built-in prompt set: the data a student of the built-in prompts was made from, so a
    cached student is made again when the set changes."""
    return hashlib.sha256("\n".join(builtin_prompts()).encode()).hexdigest()


def generate_teacher_data(
    llm,
    prompts: Sequence[str],
    *,
    num_samples: int,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = DEFAULT_TEMPERATURE,
    seed: int = 0,
    use_tqdm: bool = True,
) -> list[Example]:
    """The teacher's own answers: `llm` (a swiftkv_fast.LLM of the plain model, with a tokenizer) samples
    `num_samples` answers at `temperature` (up to `max_tokens` each, EOS included when produced) to
    user-turn `prompts` through the chat template. Sample i answers prompt order[i % len(prompts)]
    (order: a permutation seeded by `seed`, so fewer samples than prompts take distinct prompts) with
    its own sampling seed: the result depends on `seed` only, not on batching. key = the prompt."""
    from swiftkv_fast import SamplingParams

    if llm.tokenizer is None:
        raise ValueError("teacher data generation needs an LLM with a tokenizer (for the chat template)")
    config = llm.config
    if config.is_swiftkv:
        raise ValueError(
            f"the teacher must be the plain model, got a SwiftKV LLM (L={config.num_key_value_layers} < "
            f"N={config.num_hidden_layers}): build it with num_key_value_layers={config.num_hidden_layers}"
        )
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts to generate teacher data from")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"prompt {i} must be a non-empty str, got {p!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    chosen = [prompts[order[i % len(prompts)]] for i in range(num_samples)]
    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=rng.getrandbits(63))
        for _ in range(num_samples)
    ]
    prompt_ids = {p: chat_token_ids(llm.tokenizer, p) for p in dict.fromkeys(chosen)}
    outputs = llm.generate([{"prompt_token_ids": prompt_ids[p]} for p in chosen], params, use_tqdm=use_tqdm)
    examples = []
    for p, out in zip(chosen, outputs):
        ids = prompt_ids[p]
        examples.append(Example(tuple(ids) + tuple(out.outputs[0].token_ids), len(ids), key=p))
    finished = sum(out.outputs[0].finish_reason == "stop" for out in outputs)
    logger.info(
        "teacher wrote %d answers (%d answer tokens; %d ended by EOS, %d cut at max_tokens=%d)",
        len(examples),
        sum(len(e.answer_token_ids) for e in examples),
        finished,
        len(examples) - finished,
        max_tokens,
    )
    return examples


def load_jsonl(path: str | os.PathLike, tokenizer) -> list[Example]:
    """The user's data, one JSON object per line (blank lines are skipped):
    {"messages": [{"role", "content"}, ...]}: a chat whose last message is the assistant's answer; the
        prompt is everything before it through the chat template (with the generation prompt);
    {"text": "..."}: plain text; every token after the first is an answer.
    Every line is read and checked before any is tokenized; a bad one is a ValueError naming the file
    and the line number."""
    path = Path(path)
    records = _read_records(path)
    return [_tokenize(f"{path}, line {n}", record, tokenizer) for n, record in records]


def _read_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    records = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}, line {n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 ({e})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            _check_record(where, record)
            records.append((n, record))
    if not records:
        raise ValueError(f"{path}: no examples (the file is empty)")
    return records


def _check_record(where: str, record: Any) -> None:
    shape = 'expected {"messages": [...]} or {"text": "..."}'
    if not isinstance(record, dict):
        raise ValueError(f"{where}: {shape}, got a JSON {type(record).__name__}")
    if ("messages" in record) == ("text" in record):
        which = "both" if "messages" in record else "neither"
        raise ValueError(f"{where}: {shape}; this object has {which} of 'messages' and 'text'")
    if "text" in record:
        if not isinstance(record["text"], str) or not record["text"].strip():
            raise ValueError(f"{where}: 'text' must be a non-empty string, got {record['text']!r}")
        return
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for j, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(f"{where}: message {j} must be an object with string 'role' and 'content'")
    if messages[-1]["role"] != "assistant":
        raise ValueError(
            f"{where}: the last message must be the assistant's answer (role 'assistant'), "
            f"got role {messages[-1]['role']!r}"
        )
    if len(messages) < 2:
        raise ValueError(f"{where}: the conversation needs a message before the assistant's answer")
    if not messages[-1]["content"].strip():
        raise ValueError(f"{where}: the assistant's answer is empty")


def _tokenize(where: str, record: dict[str, Any], tokenizer) -> Example:
    if "text" in record:
        ids = [int(t) for t in tokenizer(record["text"])["input_ids"]]
        if len(ids) < 2:
            raise ValueError(f"{where}: the text is {len(ids)} token(s); plain text needs at least 2")
        return Example(ids, 1, key=record["text"])
    messages = record["messages"]
    try:
        prompt = chat_token_ids(tokenizer, messages[:-1], add_generation_prompt=True)
        full = chat_token_ids(tokenizer, messages, add_generation_prompt=False)
    except Exception as e:  # the template's own checks (roles, order)
        raise ValueError(f"{where}: applying the chat template failed: {e}") from e
    if full[: len(prompt)] != prompt or len(full) == len(prompt):
        raise ValueError(
            f"{where}: the chat template does not render the prompt (with its generation prompt) as a "
            "prefix of the whole conversation, so the answer tokens cannot be told apart"
        )
    return Example(full, len(prompt), key=json.dumps(messages[:-1], sort_keys=True, ensure_ascii=False))


def split_holdout(
    examples: Sequence[Example], share: float = DEFAULT_HOLDOUT_SHARE, seed: int = 0
) -> tuple[list[Example], list[Example]]:
    """(train, heldout), each in input order. A key (prompt) is held out when its seeded hash, as a
    fraction of 2**64, is below `share`; when no key is, the one with the smallest hash is (at least one
    held-out prompt); all examples of a key go to the same side."""
    if not 0 < share < 1:
        raise ValueError(f"share must be in (0, 1), got {share}")
    scores = {e.holdout_key: _unit_hash(e.holdout_key, seed) for e in examples}
    if len(scores) < 2:
        raise ValueError(
            f"holding out a share of the data needs at least 2 distinct prompts, got {len(scores)} "
            f"({len(examples)} examples)"
        )
    held = {k for k, s in scores.items() if s < share}
    if not held:
        held = {min(scores, key=lambda k: (scores[k], k))}
    elif len(held) == len(scores):
        held.remove(max(held, key=lambda k: (scores[k], k)))
    train = [e for e in examples if e.holdout_key not in held]
    heldout = [e for e in examples if e.holdout_key in held]
    logger.info(
        "held out %d of %d examples (%d of %d prompts)", len(heldout), len(examples), len(held), len(scores)
    )
    return train, heldout


def split_folds(examples: Sequence[Example], k: int, seed: int = 0) -> list[list[Example]]:
    """The examples in k folds for cross-validation by prompt, each in input order: the distinct keys
    (prompts) in the order of their seeded hash, dealt to the folds in turn, so fold sizes differ by at
    most one prompt and all examples of a prompt are in one fold.

        folds = split_folds(examples, 10)   # score folds[f] by a fit on the other nine
    """
    if k < 2:
        raise ValueError(f"cross-validation needs k >= 2 folds, got {k}")
    keys = sorted({e.holdout_key for e in examples}, key=lambda key: (_unit_hash(key, seed), key))
    if len(keys) < k:
        raise ValueError(
            f"{k} folds need at least {k} distinct prompts, got {len(keys)} ({len(examples)} examples)"
        )
    fold_of = {key: i % k for i, key in enumerate(keys)}
    folds: list[list[Example]] = [[] for _ in range(k)]
    for e in examples:
        folds[fold_of[e.holdout_key]].append(e)
    return folds


def _unit_hash(key: str, seed: int) -> float:
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def batches(
    examples: Sequence[Example],
    batch_tokens: int,
    pad_token_id: int = 0,
    *,
    max_length: int | None = None,
    seed: int | None = None,
) -> list[Batch]:
    """Pack `examples` into right-padded Batches of at most `batch_tokens` tokens (B * T, padding
    included), longest first, so each batch holds examples of similar lengths; no example is split.
    An example longer than the cap (min(max_length, batch_tokens)) is cut to it, with a warning.
    seed: None keeps the longest-first order of the batches; an int shuffles it (for training)."""
    if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
        raise ValueError(f"batch_tokens must be a positive int, got {batch_tokens!r}")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be None or a positive int, got {max_length!r}")
    if not examples:
        raise ValueError("no examples to batch")
    cap = batch_tokens if max_length is None else min(max_length, batch_tokens)
    truncated = sum(len(e) > cap for e in examples)
    if truncated:
        logger.warning(
            "%d of %d examples are longer than %d tokens and were truncated to it",
            truncated,
            len(examples),
            cap,
        )
    seqs = [(e.token_ids[:cap], min(e.answer_start, cap)) for e in examples]
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))  # stable: ties keep input order
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * len(seqs[groups[-1][0]][0]) <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    if seed is not None:
        random.Random(seed).shuffle(groups)
    return [
        Batch.from_sequences([seqs[i][0] for i in g], [seqs[i][1] for i in g], pad_token_id) for g in groups
    ]
