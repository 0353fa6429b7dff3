"""`bench distill-step`'s cases on a tiny random student: every case runs, the bf16 copies give the
casts' losses bit for bit, and the copies are given back when the stack closes."""

from __future__ import annotations

import contextlib

import pytest
import torch
from swiftkv_reference.checkpoint import swiftkv_init
from swiftkv_reference.model import SwiftKVForCausalLM
from swiftkv_reference.testing import tiny_config, tiny_model

from bench import distill_step


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cases_run_and_the_copies_change_nothing_but_the_time(precision):
    plain = tiny_config(num_hidden_layers=4)
    config, state = swiftkv_init(plain, tiny_model(plain, seed=3).state_dict(), 2, 1)
    models = []

    def make_student():
        model = SwiftKVForCausalLM(config).eval()
        model.load_state_dict(state)
        models.append(model)
        return model

    batches = distill_step.synthetic_batches(config.vocab_size, 2, 512)
    assert len(batches) == 2 and all(b.input_ids.numel() <= 512 for b in batches)
    assert all(b.logits_mask.any() and not b.logits_mask.all() for b in batches)
    with contextlib.ExitStack() as stack:
        cases = distill_step.step_cases(make_student, batches, precision, stack)
        losses = {name: call()["loss"] for name, call in cases.items()}
        if precision == "bf16":
            assert {m.model.layers[3].mlp.down_proj.weight.dtype for m in models} == {
                torch.float32,
                torch.bfloat16,
            }
    handling = ("casts", "copies") if precision == "bf16" else ("fp32",)
    assert sorted(losses) == sorted(
        f"{loss}, {h}" for loss in ("kl only", "snowflake loss") for h in handling
    )
    if precision == "bf16":
        assert losses["kl only, casts"] == losses["kl only, copies"]
        assert losses["snowflake loss, casts"] == losses["snowflake loss, copies"]
    assert all(p.dtype == torch.float32 for m in models for p in m.parameters())
