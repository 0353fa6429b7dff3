"""Meta tests of the harness itself (cheap, no model): the comparison helpers catch what they must."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .adapters.base import Output, top_logprobs_from_logits
from .checks import against_reference_twice
from .compare import assert_close, check_logits_close, check_logprobs_close, check_outputs_equal, closeness


def _out(tokens, logits=None):
    top = top_logprobs_from_logits(logits, 5) if logits is not None else None
    return Output(token_ids=list(tokens), top_logprobs=top, logits=logits)


def test_closeness_reports_max_and_mean():
    c = closeness(torch.tensor([[0.0, 1.0], [2.0, 3.0]]), torch.tensor([[0.0, 1.5], [2.0, 3.0]]))
    assert c.max_abs == pytest.approx(0.5) and c.mean_abs == pytest.approx(0.125) and c.where == (0, 1)
    with pytest.raises(AssertionError, match="max abs err 5.000e-01"):
        assert_close(torch.zeros(2), torch.tensor([0.0, 0.5]), atol=1e-4, what="x", context="REPRO")
    assert closeness(torch.tensor([float("nan")]), torch.tensor([0.0])).max_abs == float("inf")


def test_greedy_equal_reports_first_divergence():
    check_outputs_equal([_out([1, 2, 3])], [_out([1, 2, 3])], name_a="a", name_b="b")
    with pytest.raises(AssertionError, match="first divergence at generated token 1[\\s\\S]*REPRO"):
        check_outputs_equal([_out([1, 2, 3])], [_out([1, 4, 3])], name_a="a", name_b="b", context="REPRO")
    with pytest.raises(AssertionError, match="generated token 2"):
        check_outputs_equal([_out([1, 2])], [_out([1, 2, 3])], name_a="a", name_b="b")


def test_low_precision_rule():
    row = torch.arange(16, dtype=torch.float32)  # top-5: 15, 14, 13, 12, 11
    logits = torch.stack([row, row])
    same = _out([15, 15], logits)
    near = _out([15, 14], logits)  # diverges at 1, within each other's top-5
    far = _out([15, 3], logits)  # 3 is not in the top-5
    check_logprobs_close([same], [near], name_a="a", name_b="b")
    with pytest.raises(AssertionError, match="low-precision rule failed"):
        check_logprobs_close([same], [far], name_a="a", name_b="b")


def test_logits_close_requires_rows():
    a = _out([1], torch.zeros(1, 4))
    with pytest.raises(AssertionError, match="returned no logits"):
        check_logits_close([a], [_out([1])], name_a="a", name_b="b")
    with pytest.raises(AssertionError, match="request 0"):
        check_logits_close([a], [_out([1], torch.full((1, 4), 1e-3))], name_a="a", name_b="b")


def test_a_failure_runs_the_case_again_and_says_which_side_moved():
    impl = SimpleNamespace(name="impl", exact=True)
    case = SimpleNamespace(prompts=[[1]], describe=lambda: "REPRO")
    good, off = _out([1], torch.zeros(1, 4)), _out([1], torch.full((1, 4), 1e-3))
    assert "max abs err 0" in against_reference_twice(impl, [good], [good], case, rerun=None)

    def transient():  # the engine is right the second time, the reference unchanged
        return [good], [good]

    with pytest.raises(AssertionError) as failure:
        against_reference_twice(impl, [off], [good], case, transient)
    text = str(failure.value)
    assert "request 0: logits impl vs reference: max abs err 1.000e-03" in text and "REPRO" in text
    assert "impl rerun vs its first run: max abs err 1.000e-03" in text
    assert "reference recomputed vs its first run: max abs err 0.000e+00" in text
    assert "impl rerun vs reference recomputed: max abs err 0.000e+00" in text
    assert "machine: model name " in text or "machine: unknown" in text

    def broken():
        raise RuntimeError("no memory")

    with pytest.raises(
        AssertionError, match="logits impl vs reference[\\s\\S]*the rerun raised RuntimeError: no memory"
    ):
        against_reference_twice(impl, [off], [good], case, broken)
    with pytest.raises(AssertionError, match="impl rerun vs its first run: other tokens"):
        against_reference_twice(impl, [off], [good], case, lambda: ([_out([2], torch.zeros(1, 4))], [good]))
