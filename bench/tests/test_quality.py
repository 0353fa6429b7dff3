"""`bench quality`'s core on a tiny random model with synthetic examples (no tokenizer, no embedded
model): every split x method is fitted and scored, the teacher is untouched, bad splits are refused
before any work, the speed cases run, and the table / JSON / plot take the rows. No timing checked."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest
import torch

from bench import engine, quality

pytest.importorskip("swiftkv_distill")

N = 5
SPLITS = [(2, 1), (3, 1), (3, 2)]


def _examples(vocab: int, num: int, seed: int):
    from swiftkv_distill.data import Example

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        n = int(torch.randint(8, 24, (1,), generator=g))
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append(Example(ids, int(torch.randint(2, n - 2, (1,), generator=g)), key=f"{seed}-{i}"))
    return out


def _settings(config, splits=SPLITS, steps=2):
    from swiftkv_distill.pipeline import DistillSettings

    base = DistillSettings(num_key_value_layers=splits[0][0], batch_tokens=96, steps=steps, greedy_tokens=0)
    return quality.split_settings(config, splits, base)


@pytest.fixture(scope="module")
def case():
    from swiftkv_reference.testing import tiny_config, tiny_model

    teacher = tiny_model(tiny_config(num_hidden_layers=N))
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    train = _examples(teacher.config.vocab_size, 24, seed=0)
    heldout = _examples(teacher.config.vocab_size, 6, seed=1)
    rows = quality.evaluate_splits(teacher, train, heldout, _settings(teacher.config))
    return teacher, before, train, heldout, rows


def test_every_split_gets_init_calibration_and_distillation(case):
    from swiftkv_distill.evaluate import evaluate
    from swiftkv_distill.pipeline import _model
    from swiftkv_reference.checkpoint import swiftkv_init

    teacher, before, _, heldout, rows = case
    assert [(*quality._split(r), r["method"]) for r in rows] == [
        (L, G, m) for L, G in SPLITS for m in quality.METHODS
    ]
    for r in rows:
        assert 0 <= r["top1_agreement"] <= 1 and r["kl"] >= 0 and r["greedy_agreement"] is None
        assert r["num_examples"] == len(heldout) and r["num_hidden_layers"] == N
    # the first method is exactly Snowflake's init, scored like `swiftkv eval`
    init = evaluate(
        teacher, _model(*swiftkv_init(teacher.config, before, 2, 1), "cpu"), heldout, greedy_tokens=0
    )
    assert {k: rows[0][k] for k in init.to_dict()} == init.to_dict()
    by = {(*quality._split(r), r["method"]): r for r in rows}
    for L, G in SPLITS:
        assert by[L, G, "calibrated"]["kl"] < by[L, G, "snowflake init"]["kl"]
        assert by[L, G, "distilled"]["fit_seconds"] >= by[L, G, "calibrated"]["fit_seconds"]
    after = teacher.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], v) for k, v in before.items())


def test_no_steps_no_distillation_and_bad_splits_refused_before_work(case, monkeypatch):
    teacher, _, train, heldout, _ = case
    rows = quality.evaluate_splits(teacher, train, heldout, _settings(teacher.config, [(3, 1)], steps=0))
    assert [r["method"] for r in rows] == ["snowflake init", "calibrated"]

    calibrate_module = importlib.import_module("swiftkv_distill.calibrate")  # the package re-exports the name
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *a, **k: pytest.fail("ran"))
    for splits, match in (
        ([(2, 2)], "split L=2, G=2: key_value_group_size=2 must divide"),
        ([(5, 1)], "L=5"),
    ):
        with pytest.raises(ValueError, match=match):
            _settings(teacher.config, splits)
    good = _settings(teacher.config, [(3, 1)])
    with pytest.raises(ValueError, match="no splits"):
        quality.evaluate_splits(teacher, train, heldout, [])
    from swiftkv_reference.testing import tiny_config

    bigger = _settings(tiny_config(num_hidden_layers=8), [(5, 1)])
    with pytest.raises(ValueError, match="split L=5, G=1"):
        quality.evaluate_splits(teacher, train, heldout, good + bigger)


def test_parse_splits():
    assert quality.parse_splits("10,15,16:2") == [(10, 1), (15, 1), (16, 2)]
    for bad in ("a", "15:2:1", "15,15"):
        with pytest.raises(argparse.ArgumentTypeError):
            quality.parse_splits(bad)


def test_speed_cases_run_each_split_against_the_full_model():
    pytest.importorskip("swiftkv_fast")
    from swiftkv_reference.testing import random_state_dict, tiny_config

    config = tiny_config(num_hidden_layers=N)
    state = random_state_dict(config)
    built = []

    def build(L, G):
        built.append((L, G))
        return engine.build_llm(L, G, config=config, state_dict=state, kv_cache_memory=1 << 20)

    speed = quality.measure_speedups(SPLITS, build, num_prompts=2, prompt_len=16, repeat=1, warmup=0, seed=0)
    assert built == [(None, None), *SPLITS] and list(speed) == SPLITS
    for s in speed.values():
        assert s["speedup"].n == 1 and s["flop_limit"] > 1 and len(s["seconds"]) == 1


def _speed(value: float):
    from bench.harness import Stats

    return {"speedup": Stats.of([value]), "flop_limit": value + 0.1, "seconds": [1.0]}


def _data(rows):
    return {
        "train_examples": 24,
        "train_tokens": 400,
        "heldout_examples": rows[0]["num_examples"],
        "heldout_answer_tokens": rows[0]["num_answer_tokens"],
        "teacher_perplexity": rows[0]["teacher_perplexity"],
    }


def test_table_shows_each_split_once_with_its_speedup(case):
    rows = [dict(r, greedy_agreement=0.5) for r in case[-1]]
    speed = {s: _speed(1.0 + i) for i, s in enumerate(SPLITS)}
    text = quality.table(rows, speed, N, _data(rows), greedy_tokens=4).render()
    assert text.count("distilled") == len(SPLITS) and "3.00x" in text and "first 4 greedy tokens" in text
    text = quality.table(case[-1], None, N, _data(case[-1]), greedy_tokens=0).render()
    assert "not measured" in text and "1.00x" not in text


def test_json_has_every_row_with_its_split_speed(case, tmp_path, monkeypatch):
    rows = case[-1]
    monkeypatch.setattr(quality, "plot", lambda rows, speed, out: out / "quality.png")
    for speed in ({s: _speed(1.0 + i) for i, s in enumerate(SPLITS)}, None):
        paths = quality.write_outputs(tmp_path, rows, speed, {"splits": SPLITS}, _data(rows))
        assert [p.name for p in paths] == ["quality.json", "quality.png"]
        data = json.loads(paths[0].read_text())
        assert data["benchmark"] == "quality" and data["settings"] == {"splits": [list(s) for s in SPLITS]}
        assert data["data"]["train_examples"] == 24 and len(data["results"]) == len(rows)
        assert len(data["speed"]) == (len(SPLITS) if speed else 0)
        for r in data["results"]:
            assert r["method"] in quality.METHODS and 0 <= r["top1_agreement"] <= 1
            if speed:
                assert r["speedup"]["median"] == 1.0 + SPLITS.index(quality._split(r))
            else:
                assert "speedup" not in r


@pytest.mark.parametrize("with_speed", [True, False])
def test_plot(case, tmp_path, with_speed):
    pytest.importorskip("matplotlib")
    rows = [dict(r, greedy_agreement=0.5) for r in case[-1]]
    speed = {s: _speed(1.0 + i) for i, s in enumerate(SPLITS)} if with_speed else None
    path = quality.plot(rows, speed, tmp_path)
    assert path == tmp_path / "quality.png" and path.stat().st_size > 0


def test_cross_validation_scores_each_fold_by_a_fit_on_the_others(case):
    """--folds: every example is scored once, by students fitted on the other folds only (the same
    figures as fitting those folds directly and scoring the fold), the folds pooled with their standard
    error; the teacher is untouched."""
    from swiftkv_distill.calibrate import calibrate
    from swiftkv_distill.data import batches, split_folds
    from swiftkv_distill.evaluate import EvalResult, evaluate
    from swiftkv_distill.pipeline import _model
    from swiftkv_reference.checkpoint import swiftkv_init

    teacher, before, train, heldout, _ = case
    examples = train + heldout
    folds = split_folds(examples, 3, seed=0)
    settings = _settings(teacher.config)
    rows = quality.cross_validate_splits(teacher, folds, settings)
    assert [(*quality._split(r), r["method"]) for r in rows] == [
        (L, G, m) for L, G in SPLITS for m in quality.METHODS
    ]
    for r in rows:
        assert r["folds"] == 3 and len(r["fold_top1_agreement"]) == 3
        assert r["num_examples"] == len(examples) and r["top1_agreement_se"] >= 0 and r["kl_se"] >= 0
        assert min(r["fold_top1_agreement"]) <= r["top1_agreement"] <= max(r["fold_top1_agreement"])
    by = {(*quality._split(r), r["method"]): r for r in rows}
    init = evaluate(
        teacher, _model(*swiftkv_init(teacher.config, before, 3, 2), "cpu"), examples, greedy_tokens=0
    )
    assert by[3, 2, "snowflake init"]["top1_agreement"] == pytest.approx(init.top1_agreement)
    direct = []  # L = 3, G = 1 calibrated on two folds, scored on the third, by hand
    for f, fold in enumerate(folds):
        rest = [e for g, other in enumerate(folds) if g != f for e in other]
        student = _model(
            *calibrate(teacher, batches(rest, settings[0].batch_tokens, 0), 3, progress=False), "cpu"
        )
        direct.append(evaluate(teacher, student, fold, greedy_tokens=0))
    pooled = EvalResult.pooled(direct)
    got = by[3, 1, "calibrated"]
    assert got["fold_top1_agreement"] == pytest.approx([r.top1_agreement for r in direct], abs=1e-9)
    assert got["kl"] == pytest.approx(pooled.kl, rel=1e-4)
    assert got["top1_agreement"] == pytest.approx(pooled.top1_agreement, abs=1e-9)
    assert by[3, 1, "distilled"]["fit_seconds"] >= got["fit_seconds"]
    after = teacher.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())

    text = quality.table(rows, None, N, {**_data(rows), "folds": 3}, greedy_tokens=0).render()
    assert "3-fold cross-validation by prompt" in text and " +- " in text and "other 2" in text
    with pytest.raises(ValueError, match="at least 2 non-empty folds"):
        quality.cross_validate_splits(teacher, [examples], settings)


def test_folds_option():
    assert quality._folds("10") == 10
    for bad in ("0", "-2", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--folds must be an integer >= 1"):
            quality._folds(bad)


def test_flags_reach_the_settings_every_split_shares():
    from bench.__main__ import build_parser

    flags = ["--steps", "3", "--lr", "1e-3", "--logits-loss-temp", "1", "--hidden-loss-mult", "0"]
    args = build_parser().parse_args(["quality", "--quick", *flags])
    base = quality.base_settings(args, quality.QUICK_SPLITS)
    assert (base.steps, base.lr, base.logits_loss_temp, base.hidden_loss_mult) == (3, 1e-3, 1.0, 0.0)
    assert (base.num_samples, base.greedy_tokens) == (quality.QUICK_NUM_SAMPLES, 0)
    defaults = quality.base_settings(build_parser().parse_args(["quality"]), quality.SPLITS)
    assert (defaults.lr, defaults.logits_loss_temp, defaults.hidden_loss_mult) == (2e-4, 2.0, 1.0)
    args = build_parser().parse_args(["quality", "--hidden-loss-mult", "-1"])
    with pytest.raises(ValueError, match="^hidden_loss_mult must be"):
        quality.base_settings(args, quality.SPLITS)
