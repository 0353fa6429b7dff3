"""The model built under the engine's kernel plan (kernels/plan.py), and what is measured on it added to
the plan: each linear's kernels per row count with the memory its layouts cost beyond one copy of its
weight, the decode stacks (worker/stack_timing.py), and which weight forms were kept
(worker/form_timing.py). Every choice is made here, once; the model only runs what it was given."""

from __future__ import annotations

import hashlib

import torch
from swiftkv_reference.memory import device_memory_bytes

from swiftkv_fast import envs
from swiftkv_fast.kernels.linear_kernels import (
    BUSY_SHARE,
    FORM_NAMES,
    LinearKernelChooser,
    cache_file,
    row_buckets,
    weights_exceed_cache,
)
from swiftkv_fast.kernels.plan import KernelPlan, cpu_bf16_units
from swiftkv_fast.logger import init_logger
from swiftkv_fast.model.layers import RotaryTable, RowOps
from swiftkv_fast.model.loader import build_weights, kernel_cache_dir
from swiftkv_fast.model.swiftkv_model import SwiftKVModel
from swiftkv_fast.model.tp_sharding import TensorParallelShard
from swiftkv_fast.worker import form_timing
from swiftkv_fast.worker.stack_timing import choose_decode_stacks

logger = init_logger(__name__)

# the whole steps the weight forms are judged by (worker/form_timing.py): a decode batch and a prompt
FORM_DECODE_ROWS, FORM_PREFILL_ROWS = 32, 512


def build_model(config, econf, layout, state_dict, tp, plan: KernelPlan, backend, kv_cache) -> SwiftKVModel:
    """The rank's model over `state_dict` with the plan's kernels; fills in the plan's measured part."""
    shard = TensorParallelShard.of(config, tp.rank, tp.size)
    ops = RowOps(plan.row_ops)
    stack = plan.decode_stack is not None
    auto_cpu = plan.device == "cpu" and econf.linear_kernel == "auto"
    linear_kernel = None
    if auto_cpu and econf.compute_dtype != torch.float32 and not cpu_bf16_units():
        # every candidate emulates bf16 products here, slowly: timing them would take minutes
        linear_kernel, auto_cpu = "linear", False
    cache_path = cache_file(kernel_cache_dir()) if auto_cpu else None
    cold = weights_exceed_cache(state_dict, econf.dtype)

    def make(forms: bool):
        with envs.kernels_disabled(plan.disabled):
            weights, chooser = build_weights(
                config,
                state_dict,
                econf,
                layout,
                ops,
                decode_stack=stack,
                forms=forms,
                linear_kernel=linear_kernel,
            )
        model = SwiftKVModel(
            weights,
            num_key_value_layers=config.num_key_value_layers,
            num_heads=shard.num_heads,
            num_kv_heads=shard.num_kv_heads,
            head_dim=config.head_dim,
            eps=config.rms_norm_eps,
            rotary=RotaryTable(weights.rope_inv_freq, econf.max_model_len, torch.device(econf.device), ops),
            layout=layout,
            backend=backend,
            tp=tp,
            vocab_start=shard.vocab_start,
            stack_kernel=plan.decode_stack,
        )
        stacks = {}
        if stack and auto_cpu:
            decode = min(econf.max_num_seqs, econf.max_num_batched_tokens)
            buckets = [
                b for b in row_buckets(econf.max_num_seqs, econf.max_num_batched_tokens) if b <= decode
            ]
            stacks = choose_decode_stacks(model, kv_cache, buckets, cache_path=cache_path, cold=cold)
        return model, chooser, stacks

    model, chooser, stacks = make(forms=True)
    forms = None
    if auto_cpu and chooser.forms_found and "gemm-4bit" not in plan.disabled:
        model, chooser, stacks, forms = _judge_forms(
            make, (model, chooser, stacks), econf, layout, state_dict, kv_cache, cache_path, cold
        )
    add_measured(plan, chooser, stacks, forms)
    return model


def _judge_forms(make, compact, econf, layout, state_dict, kv_cache, cache_path, cold):
    """The compact forms' build or the plain fp32 one, whichever serves whole steps faster (see
    worker/form_timing.py); -> (model, chooser, stacks, the plan's note)."""
    chooser = compact[1]
    names = "/".join(sorted(FORM_NAMES.get(f, f) for f in chooser.forms_found))
    weight_bytes = sum(t.numel() for t in state_dict.values()) * econf.dtype.itemsize
    memory = device_memory_bytes(econf.device)
    if memory is not None and 2 * weight_bytes > memory // 2:
        return (*compact, f"compact ({names}): not judged, two builds of the weights would not fit in memory")
    rows = {
        "decode": min(FORM_DECODE_ROWS, econf.max_num_seqs, econf.max_num_batched_tokens),
        "prefill": min(FORM_PREFILL_ROWS, econf.max_num_batched_tokens, econf.max_model_len),
    }
    shapes = hashlib.sha1(repr((sorted(chooser.choices), layout.num_groups)).encode()).hexdigest()[:16]
    key = form_timing.forms_key(shapes, rows["decode"], rows["prefill"], cold)
    times = form_timing.cached_times(cache_path, key, rows)
    plain = None
    if times is None:
        plain = make(forms=False)
        models = {"compact": compact[0], "fp32": plain[0]}
        times, busy = form_timing.time_forms(
            models, kv_cache, layout.num_groups, rows["decode"], rows["prefill"], cold
        )
        if busy <= BUSY_SHARE:
            form_timing.save_times_of(cache_path, key, rows, times)
        else:
            logger.warning(
                "the CPU was busy while the weight forms were timed (threads waited %.0f%% of the time for "
                "a core): their choice holds for this process only",
                100 * busy,
            )
    keep, why = form_timing.choose(times)
    if keep == "compact":
        return (*compact, f"compact ({names}): {why}")
    plain = plain or make(forms=False)
    return (*plain, f"fp32 ({names} forms not used): {why}")


def add_measured(
    plan: KernelPlan, chooser: LinearKernelChooser, stacks: dict[str, str], forms: str | None = None
) -> None:
    if not chooser.on_cpu:
        plan.add("linears", "F.linear", "not on CPU")
        return
    where = f" in {chooser.cache_path}" if chooser.cache_path and chooser.kernel == "auto" else ""
    plan.add(
        "linears", chooser.how(), f"{_mib(chooser.extra_bytes)} of layouts beyond one copy of each weight"
    )
    for label, described in chooser.choices.items():
        plan.add(f"  {label}", described, _mib(chooser.choice_bytes.get(label, 0)))
    reasons: dict[str, list[str]] = {}
    for kernel, why in sorted(chooser.absent.items()):
        reasons.setdefault(why, []).append(kernel)
    for why, kernels in reasons.items():
        plan.add(f"  not offered: {', '.join(kernels)}", "-", why)
    if where:
        plan.add("  timings", "-", f"cached{where} (delete it to time again)")
    if forms is not None:
        plan.add("weight forms", forms.split(":")[0], forms.partition(": ")[2])
    for half, described in stacks.items():
        plan.add(f"decode stack, {half} half", *described.split(": ", 1))


def _mib(nbytes: int) -> str:
    return f"{'+' if nbytes >= 0 else '-'}{abs(nbytes) / 2**20:.1f} MiB"
