"""Snowflake's distillation of the SwiftKV parameters (the optional second stage of `swiftkv distill`),
as ArcticTraining's `projects/swiftkv/train.py` has it (anchors/swiftkv-facts.md §1.4).

The teacher is the same model with SwiftKV off (training_forward(..., swiftkv=False), without
gradients); the student is the SwiftKV path. Only norm_swiftkv, q_proj_swiftkv and k/v_proj_swiftkv
train; every other tensor is frozen (requires_grad False) and never written. Per micro-batch:

    logits_loss = T^2 * mean over the scored positions (Batch.logits_mask) of
                  KL(softmax(teacher / T) || softmax(student / T))        T = logits_loss_temp = 2
    hidden_loss = mean over the real tokens and hidden units of (h_student - h_teacher)^2
    loss        = logits_loss + hidden_loss_mult * hidden_loss            hidden_loss_mult = 1

With hidden_loss_mult = 0 nothing needs the student's layers >= L off the scored positions, so they run
only there (training_forward's scored_only, SwiftKV's own saving), and the hidden_loss reported (not
trained on) is the MSE at the scored positions.

`hidden_loss_layer` indexes Hugging Face's `hidden_states` tuple as ArcticTraining does:
(h_0, ..., h_{N-1}, norm(h_N)), h_i the residual stream entering layer i. Its default, -2, is h_{N-1}:
the stream entering the last decoder layer (not the final norm's input; -1 is the final norm's output).

Optimizer as Snowflake's recipe: AdamW (lr 2e-4, betas 0.9/0.999, weight decay 0, never on norms and
biases), warm-up over int(warmup_ratio * steps) steps (warmup_ratio 0.05), the gradient norm clipped to
1.0 (ArcticTraining's DeepSpeed default). Each micro-batch's loss is divided by
gradient_accumulation_steps. The forwards run in fp32 or under bf16 autocast over fp32 weights
(`precision`; "auto": bf16 on CUDA, and on CPU when a measured decoder layer is enough faster in bf16,
see precision.py). Where we differ from ArcticTraining:
- the KL is a mean over the scored positions; ArcticTraining averages the masked KL over all B*T
  positions (prompt and padding too), which weights a batch by its share of answer tokens. Its mask,
  labels != -100, marks the logits at the answer tokens; ours marks the logits that predict them;
- the MSE skips padding (the pads' outputs are garbage);
- the learning rate decays by a cosine after the warm-up (ArcticTraining's default scheduler decays
  linearly), and step s (0-based) of the warm-up uses lr * (s + 1) / warmup_steps, so no step has lr 0.

Batches are read in order and cycled (so `batches` must be re-iterable and give the same sequence
each time for a resumed run to equal an uninterrupted one); the teacher's outputs are kept for later
epochs (TeacherCache), and `swiftkv distill` fills them from calibration's pass over the same batches,
so no epoch runs the teacher again. Checkpoints (trainer_state.py) hold the
trainable tensors, AdamW's state, the step, the RNG states and the loss history; `resume=True`
continues from the newest one, skipping the micro-batches it consumed, bit-for-bit on CPU.

    config, state = calibrate(teacher, batches, num_key_value_layers=15)
    student = SwiftKVForCausalLM(config); student.load_state_dict(state)
    result = distill(student, batches, DistillConfig(steps=300), checkpoint_dir="ckpt")  # in place
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from swiftkv_reference.config import SwiftKVConfig
from swiftkv_reference.model import SwiftKVForCausalLM
from tqdm.auto import tqdm

from .batch import Batch
from .forward import ForwardOutput, final_logits, training_forward
from .precision import autocast, check_precision, frozen_weights_in_bf16, resolve_precision
from .trainer_state import (
    TrainerState,
    checkpoint_path,
    list_checkpoints,
    load_trainer_state,
    rng_state,
    save_trainer_state,
    set_rng_state,
)

logger = logging.getLogger(__name__)

SWIFTKV_MODULES = frozenset({"norm_swiftkv", "q_proj_swiftkv", "k_proj_swiftkv", "v_proj_swiftkv"})
# settings a resumed run may change
_NOT_TRAJECTORY = ("checkpoint_every", "keep_checkpoints", "teacher_cache_gib", "precision")
_HISTORY = ("loss", "logits_loss", "hidden_loss", "lr", "grad_norm")


@dataclass(frozen=True)
class DistillConfig:
    """The distillation settings (ArcticTraining's names and defaults where it has them); checked
    on construction, each error naming its field."""

    steps: int  # optimizer steps
    lr: float = 2e-4
    warmup_ratio: float = 0.05  # share of the steps with a linear warm-up
    gradient_accumulation_steps: int = 1  # micro-batches (Batch objects) per optimizer step
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0  # None: no clipping
    logits_loss_temp: float = 2.0
    hidden_loss_mult: float = 1.0
    hidden_loss_layer: int = -2  # index into (h_0, ..., h_{N-1}, norm(h_N)); see the module docstring
    checkpoint_every: int | None = None  # steps between checkpoints (with a checkpoint_dir); None: at the end
    keep_checkpoints: int | None = 2  # newest checkpoints kept; None keeps all
    teacher_cache_gib: float = 4.0  # keep the teacher's outputs for later epochs up to this much; 0: never
    precision: str = "auto"  # "fp32", "bf16" (autocast), or "auto": measured (precision.py); resumed as saved

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        _check_int("steps", self.steps, 1)
        _check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, 1)
        _check_int("hidden_loss_layer", self.hidden_loss_layer, None)
        for name in ("checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        _check_float("lr", self.lr, "> 0", lambda x: x > 0)
        _check_float("warmup_ratio", self.warmup_ratio, "in [0, 1]", lambda x: 0 <= x <= 1)
        _check_float("weight_decay", self.weight_decay, ">= 0", lambda x: x >= 0)
        _check_float("eps", self.eps, "> 0", lambda x: x > 0)
        _check_float("logits_loss_temp", self.logits_loss_temp, "> 0", lambda x: x > 0)
        _check_float("hidden_loss_mult", self.hidden_loss_mult, ">= 0", lambda x: x >= 0)
        _check_float("teacher_cache_gib", self.teacher_cache_gib, ">= 0", lambda x: x >= 0)
        check_precision(self.precision, "DistillConfig.precision")
        if self.max_grad_norm is not None:
            _check_float("max_grad_norm", self.max_grad_norm, "> 0 (or None)", lambda x: x > 0)
        if len(self.betas) != 2 or not all(_is_real(b) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"DistillConfig.betas must be two numbers in [0, 1), got {self.betas!r}")

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_ratio * self.steps)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based): linear warm-up to `lr`, then a cosine
        decay towards 0 (which the last step does not reach)."""
        warmup = self.warmup_steps
        if step < warmup:
            return self.lr * (step + 1) / warmup
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (self.steps - warmup)))


@dataclass
class DistillResult:
    """The history of every optimizer step from the first (a resumed run includes the earlier ones)."""

    losses: list[float] = field(default_factory=list)  # logits_loss + hidden_loss_mult * hidden_loss
    logits_losses: list[float] = field(default_factory=list)  # T^2 * KL, mean over the step's micro-batches
    hidden_losses: list[float] = field(default_factory=list)  # MSE, likewise
    learning_rates: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # before clipping
    start_step: int = 0  # the step this call resumed from
    seconds_per_step: float = math.nan  # wall time per step run by this call
    precision: str = "fp32"  # the arithmetic the steps ran in: "fp32" or "bf16" (autocast)
    checkpoint: Path | None = None  # the newest checkpoint written (or resumed from)


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    temperature: float = 2.0,
    hidden_loss_mult: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """*_logits: (P, vocab) at the scored positions; *_hidden: (n, hidden) at the real tokens.
    Returns scalars (loss, logits_loss, hidden_loss), in fp32; no scored position gives logits_loss 0.
    The KL and its gradient are computed together, a few rows at a time (_ChunkedKL)."""
    logits_loss = _ChunkedKL.apply(student_logits, teacher_logits.detach(), float(temperature))
    hidden_loss = F.mse_loss(student_hidden.float(), teacher_hidden.float())
    return logits_loss + hidden_loss_mult * hidden_loss, logits_loss, hidden_loss


class _ChunkedKL(torch.autograd.Function):
    """T^2 * mean over the P rows of KL(softmax(teacher / T) || softmax(student / T)), and its gradient
    with respect to the student's logits, T / P * (softmax(student / T) - softmax(teacher / T)), computed
    in the same pass, CHUNK_BYTES of rows at a time: each chunk's softmaxes stay in cache where
    autograd's graph makes a dozen passes over (P, vocab) tensors in memory (about half the time on CPU).
    The gradient is kept for backward, scaled in the chunk's pass; at T = 1 and without accumulation the
    divisions and the multiplication by the upstream gradient, exact no-ops, are skipped (bit for bit the
    same). Under bf16 autocast the logits stay bf16 until their chunk is upcast, and the gradient is kept
    in bf16 (the fp32 one rounded once, as autocast would cast it for the output projection's backward):
    no (P, vocab) fp32 copies of either."""

    CHUNK_BYTES = 4 << 20

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
        rows, vocab = student.shape
        # the gradient in the logits' own dtype (what their backward consumes: bf16 under autocast)
        grad = torch.empty(student.shape, dtype=student.dtype, device=student.device)
        total = torch.zeros((), dtype=torch.float64, device=student.device)
        step = max(1, _ChunkedKL.CHUNK_BYTES // max(4 * vocab, 1))
        scale = temperature / max(rows, 1)
        for a in range(0, rows, step):
            s, t = student[a : a + step].float(), teacher[a : a + step].float()
            if temperature != 1.0:  # x / 1 is x: at T = 1 the two passes are skipped, bit for bit
                s, t = s / temperature, t / temperature
            log_p_student = F.log_softmax(s, dim=-1)
            log_p_teacher = F.log_softmax(t, dim=-1)
            p_teacher = log_p_teacher.exp()
            # rows summed in fp32, the rows' sums in fp64 (a sum(dtype=float64) of the whole chunk
            # would first copy it to fp64)
            total += (p_teacher * (log_p_teacher - log_p_student)).sum(-1).sum(dtype=torch.float64)
            if grad.dtype == torch.float32:
                torch.sub(log_p_student.exp_(), p_teacher, out=grad[a : a + step]).mul_(scale)
            else:
                grad[a : a + step] = log_p_student.exp_().sub_(p_teacher).mul_(scale)
        ctx.save_for_backward(grad)
        return (total * temperature**2 / max(rows, 1)).float()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if grad_output.device.type != "cpu" or float(grad_output) != 1.0:  # one step, no accumulation: 1
            grad = grad * grad_output
        return grad, None, None


def trainable_parameters(model: SwiftKVForCausalLM) -> dict[str, torch.nn.Parameter]:
    """The SwiftKV parameters (norm_swiftkv, q/k/v_proj_swiftkv), by name, in module order."""
    return {name: p for name, p in model.named_parameters() if SWIFTKV_MODULES.intersection(name.split("."))}


def distill(
    model: SwiftKVForCausalLM,
    batches: Iterable[Batch],
    config: DistillConfig,
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    device: torch.device | str | None = None,
    progress: bool = True,
    teacher_cache: TeacherCache | None = None,
) -> DistillResult:
    """Train `model`'s SwiftKV parameters in place (see the module docstring); returns the history.

    model: a SwiftKV model (L < N), e.g. calibrated; it is moved to `device` (default: where it is)
        in fp32. batches: re-iterable, cycled; one Batch is one micro-batch. checkpoint_dir: where
        checkpoints go; it must hold none unless `resume`. resume: continue from its newest checkpoint
        (none there: start at step 0). The settings, the model, the checkpoint and the batches are
        checked before any work (a refusal leaves the model untouched); on return the requires_grad
        flags and the train/eval mode are as they were. teacher_cache: the teacher's outputs already
        computed (e.g. by calibration's pass, see TeacherCache), used and added to; None: a new one."""
    _check_model(model, config)
    if teacher_cache is not None:
        teacher_cache.check(model, config)
    trainable = trainable_parameters(model)
    if isinstance(batches, Iterator):
        raise TypeError(
            "batches must be re-iterable (a list, or an object whose __iter__ starts over), "
            "not a one-shot iterator: distillation cycles over it"
        )
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    state = _resume_state(ckpt_dir, resume, config, model, trainable)
    if next(iter(batches), None) is None:
        raise ValueError("batches is empty")
    device = torch.device(device) if device is not None else next(model.parameters()).device

    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    was_training = model.training
    try:
        model.to(device=device, dtype=torch.float32).eval()
        trainable = trainable_parameters(model)
        for name, p in model.named_parameters():
            p.requires_grad_(name in trainable)
        precision = _resumed_precision(state, device) or resolve_precision(config.precision, model, device)
        with frozen_weights_in_bf16(model, precision, device) as lm_weight:
            return _train(
                model,
                batches,
                config,
                trainable,
                state,
                ckpt_dir,
                device,
                precision,
                progress,
                lm_weight,
                teacher_cache,
            )
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(flags[name])
        model.train(was_training)


def _train(
    model: SwiftKVForCausalLM,
    batches: Iterable[Batch],
    config: DistillConfig,
    trainable: dict[str, torch.nn.Parameter],
    state: TrainerState | None,
    ckpt_dir: Path | None,
    device: torch.device,
    precision: str,
    progress: bool,
    lm_weight: torch.Tensor | None,
    teacher_cache: TeacherCache | None,
) -> DistillResult:
    optimizer = _optimizer(trainable, config)
    history: dict[str, list[float]] = {k: [] for k in _HISTORY}
    start, checkpoint = 0, None
    if state is not None:
        start, checkpoint = state.step, checkpoint_path(ckpt_dir, state.step)
        with torch.no_grad():
            for name, p in trainable.items():
                p.copy_(state.params[name])
        _load_optimizer_state(optimizer, trainable, state.optimizer)
        set_rng_state(state.rng)
        history = {k: list(state.meta["history"][k]) for k in _HISTORY}
        logger.info("resuming distillation from %s (step %d of %d)", checkpoint, start, config.steps)

    accum = config.gradient_accumulation_steps
    micro_batches = _cycle(batches, skip=start * accum)
    cache = teacher_cache if teacher_cache is not None else TeacherCache(model.config, config)
    params = list(trainable.values())
    bar = tqdm(total=config.steps, initial=start, desc="distill", unit="step", disable=not progress)
    t0 = time.perf_counter()
    for step in range(start, config.steps):
        lr = config.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(3, dtype=torch.float64)  # loss, logits_loss, hidden_loss
        for _ in range(accum):
            batch = next(micro_batches)
            batch = batch.to(device)
            with autocast(precision, device):
                parts = _micro_batch_loss(model, batch, config, cache, lm_weight)
            (parts[0] / accum).backward()
            sums += torch.stack([p.detach().double().cpu() for p in parts])
        max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        optimizer.step()
        loss, logits_loss, hidden_loss = (sums / accum).tolist()
        for key, value in zip(_HISTORY, (loss, logits_loss, hidden_loss, lr, grad_norm)):
            history[key].append(value)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", kl=f"{logits_loss:.4f}", lr=f"{lr:.2e}")
        done = step + 1
        due = config.checkpoint_every is not None and done % config.checkpoint_every == 0
        if ckpt_dir is not None and (due or done == config.steps):
            optimizer_state = _optimizer_state(optimizer, trainable)
            meta = _meta(model, config, trainable, history) | {"precision": precision}
            snapshot = TrainerState(done, dict(trainable), optimizer_state, rng_state(), meta)
            checkpoint = save_trainer_state(ckpt_dir, snapshot, config.keep_checkpoints)
    bar.close()
    if cache.num_hits:
        logger.info(
            "teacher outputs: %d computed, %d reused (%.0f MiB kept)",
            cache.num_misses,
            cache.num_hits,
            cache.nbytes / 2**20,
        )
    ran = config.steps - start
    return DistillResult(
        losses=history["loss"],
        logits_losses=history["logits_loss"],
        hidden_losses=history["hidden_loss"],
        learning_rates=history["lr"],
        grad_norms=history["grad_norm"],
        start_step=start,
        seconds_per_step=(time.perf_counter() - t0) / ran if ran else math.nan,
        checkpoint=checkpoint,
        precision=precision,
    )


@dataclass
class TeacherOutputs:
    """What the loss needs from the teacher for one micro-batch (the same every epoch)."""

    first: int  # the layer where the two paths part (the student starts there)
    start: torch.Tensor  # (B, T, hidden): h_first
    hidden: torch.Tensor  # (n, hidden): the hidden-loss target at the real (or the scored) tokens
    final: torch.Tensor  # (P, hidden): the stream entering the final norm at the scored positions

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.start, self.hidden, self.final))


class TeacherCache:
    """The teacher's outputs per micro-batch, keyed by its tokens and masks, kept while they fit in
    max_bytes (default: config.teacher_cache_gib): later epochs then skip the teacher's forward (its
    logits are one lm_head away from `final`).

    Any teacher forward over a batch that kept `keep_states` can fill it (`offer`), e.g. calibration's
    pass, which runs the same teacher over the same batches in another order (`expect` limits what is
    kept to the batches distillation will read):

        cache = TeacherCache(student.config, distill_config)
        cache.expect(train_batches)
        calibrate(teacher, cal_batches, 15, keep_states=cache.keep_states,
                  on_batch=lambda batch, out: cache.offer(teacher, batch, out))
        distill(student, train_batches, distill_config, teacher_cache=cache)  # no teacher forward left
    """

    def __init__(self, student_config: SwiftKVConfig, config: DistillConfig, max_bytes: int | None = None):
        n = student_config.num_hidden_layers
        self.num_hidden_layers, self.num_key_value_layers = n, student_config.num_key_value_layers
        self.hidden_loss_layer = config.hidden_loss_layer % (n + 1)  # n: norm(h_N)
        self.scored_only = config.hidden_loss_mult == 0  # the student's layers >= L run the scored rows only
        self.first = min(self.num_key_value_layers, self.hidden_loss_layer)  # where the two paths part
        self.hidden_states = frozenset({self.hidden_loss_layer} - {n})  # what the student keeps
        self.keep_states = self.hidden_states | {self.first}  # what a teacher forward must keep
        self.max_bytes = int(config.teacher_cache_gib * 2**30) if max_bytes is None else max_bytes
        self.nbytes = self.num_hits = self.num_misses = 0
        self.outputs: dict[tuple, TeacherOutputs] = {}
        self._expected: set[tuple] | None = None

    @staticmethod
    def key(batch: Batch) -> tuple:
        digest = hashlib.blake2b(digest_size=16)
        for t in (batch.input_ids, batch.attention_mask, batch.answer_mask):
            digest.update(t.detach().cpu().contiguous().numpy().tobytes())
        return tuple(batch.input_ids.shape), digest.hexdigest()

    def expect(self, batches: Iterable[Batch]) -> None:
        """offer() keeps only these batches' outputs from now on."""
        self._expected = {self.key(b) for b in batches}

    def teacher_outputs(self, model: SwiftKVForCausalLM, batch: Batch, out: ForwardOutput) -> TeacherOutputs:
        """The record of a teacher forward over `batch` (on its device) that kept `keep_states`."""
        rows = batch.logits_mask if self.scored_only else batch.attention_mask  # (B, T): where the MSE is
        hidden = _hidden_state(model, out, self.hidden_loss_layer)[rows]
        return TeacherOutputs(self.first, out.states[self.first], hidden, out.hidden[batch.logits_mask])

    def offer(self, model: SwiftKVForCausalLM, batch: Batch, out: ForwardOutput) -> bool:
        """Keep the outputs of a teacher forward done elsewhere, if expected and there is room."""
        key = self.key(batch)
        if key in self.outputs or (self._expected is not None and key not in self._expected):
            return False
        return self._put(key, self.teacher_outputs(model, batch, out))

    def get(self, model: SwiftKVForCausalLM, batch: Batch) -> TeacherOutputs:
        """The teacher's outputs for `batch`: kept, or computed now (and kept if there is room)."""
        key = self.key(batch)
        if key in self.outputs:
            self.num_hits += 1
            return self.outputs[key]
        self.num_misses += 1
        with torch.no_grad():
            out = training_forward(
                model, batch.input_ids, swiftkv=False, compute_logits=False, keep_states=self.keep_states
            )
            outputs = self.teacher_outputs(model, batch, out)
        self._put(key, outputs)
        return outputs

    def _signature(self) -> tuple:
        """What the kept records depend on (first and keep_states follow from it)."""
        return self.num_hidden_layers, self.num_key_value_layers, self.hidden_loss_layer, self.scored_only

    def _put(self, key: tuple, outputs: TeacherOutputs) -> bool:
        if self.nbytes + outputs.nbytes > self.max_bytes:
            return False
        self.outputs[key] = outputs
        self.nbytes += outputs.nbytes
        return True

    def check(self, model: SwiftKVForCausalLM, config: DistillConfig) -> None:
        """Refuse a cache made for another model or loss."""
        other = TeacherCache(model.config, config, 0)
        mine, theirs = self._signature(), other._signature()
        if mine != theirs:
            raise ValueError(
                "teacher_cache was made for another model or loss (layers, L, hidden-loss layer, "
                f"scored rows only: {mine}, this run needs {theirs})"
            )


def _micro_batch_loss(
    model: SwiftKVForCausalLM,
    batch: Batch,
    config: DistillConfig,
    cache: TeacherCache,
    lm_weight: torch.Tensor | None = None,
):
    """(loss, logits_loss, hidden_loss) of one Batch; the teacher runs without gradients (or comes from
    the cache), and the student starts at layer `cache.first` from the teacher's state there (its
    layers below are the teacher's, frozen). lm_weight: the output projection to use (None: the
    model's)."""
    teacher = cache.get(model, batch)
    with torch.no_grad():
        teacher_logits = final_logits(model, teacher.final, lm_weight, fp32=False)  # (P, vocab)
    student = training_forward(
        model,
        batch.input_ids,
        swiftkv=True,
        logits_mask=batch.logits_mask,
        keep_states=cache.hidden_states,
        start=(teacher.first, teacher.start),
        scored_only=cache.scored_only,
        lm_weight=lm_weight,
        fp32_logits=False,  # bf16 under autocast: the KL upcasts them a few rows at a time
    )
    # (B, T, hidden), or (P, hidden) if scored_only
    student_hidden = _hidden_state(model, student, cache.hidden_loss_layer)
    rows = batch.logits_mask if cache.scored_only else batch.attention_mask
    return distill_loss(
        student.logits,
        teacher_logits,
        student_hidden[rows] if student_hidden.dim() == 3 else student_hidden,
        teacher.hidden,
        config.logits_loss_temp,
        config.hidden_loss_mult,
    )


def _hidden_state(model: SwiftKVForCausalLM, out: ForwardOutput, layer: int) -> torch.Tensor:
    """Entry `layer` of (h_0, ..., h_{N-1}, norm(h_N)): (B, T, hidden), or (P, hidden) past layer L of a
    scored_only forward."""
    return out.states[layer] if layer < model.config.num_hidden_layers else model.model.norm(out.hidden)


def _cycle(batches: Iterable[Batch], skip: int) -> Iterator[Batch]:
    """The batches in order, over and over, after skipping the first `skip`."""
    while True:
        for batch in batches:
            if skip:
                skip -= 1
                continue
            yield batch


def _optimizer(trainable: dict[str, torch.nn.Parameter], config: DistillConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the projection weights only (not on norms and biases)."""
    groups = [{"params": [], "weight_decay": config.weight_decay}, {"params": [], "weight_decay": 0.0}]
    for name, p in trainable.items():
        decays = name.endswith(".weight") and not name.startswith("model.norm_swiftkv.")
        groups[0 if decays else 1]["params"].append(p)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=config.lr, betas=config.betas, eps=config.eps
    )


def _optimizer_state(
    optimizer: torch.optim.Optimizer, trainable: dict[str, torch.nn.Parameter]
) -> dict[str, dict[str, torch.Tensor]]:
    return {name: dict(optimizer.state[p]) for name, p in trainable.items() if p in optimizer.state}


def _load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    trainable: dict[str, torch.nn.Parameter],
    saved: dict[str, dict[str, torch.Tensor]],
) -> None:
    names = {id(p): name for name, p in trainable.items()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    full = optimizer.state_dict()  # its "state" is keyed by the index of the parameter in `order`
    full["state"] = {i: dict(saved[name]) for i, name in enumerate(order) if name in saved}
    optimizer.load_state_dict(full)


def _meta(model, config: DistillConfig, trainable, history) -> dict:
    return {
        "config": dataclasses.asdict(config),
        "model": _model_signature(model),
        "trainable": {name: list(p.shape) for name, p in trainable.items()},
        "history": history,
    }


def _model_signature(model: SwiftKVForCausalLM) -> dict:
    c = model.config
    return {
        "model_type": c.model_type,
        "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_layers": c.num_key_value_layers,
        "key_value_group_size": c.key_value_group_size,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
    }


def _check_model(model: SwiftKVForCausalLM, config: DistillConfig) -> None:
    if not isinstance(config, DistillConfig):
        raise TypeError(f"config must be a DistillConfig, got {type(config).__name__}")
    c = model.config
    n = c.num_hidden_layers
    if not c.is_swiftkv:
        raise ValueError(
            f"distill needs a SwiftKV model (num_key_value_layers < num_hidden_layers = {n}); "
            "make one with calibrate() or swiftkv_init() first"
        )
    if not -(n + 1) <= config.hidden_loss_layer <= n:
        raise ValueError(
            f"DistillConfig.hidden_loss_layer must be in [{-(n + 1)}, {n}] for a {n}-layer model "
            f"(an index into its {n + 1} hidden states), got {config.hidden_loss_layer}"
        )


def _resume_state(
    ckpt_dir: Path | None,
    resume: bool,
    config: DistillConfig,
    model: SwiftKVForCausalLM,
    trainable: dict[str, torch.nn.Parameter],
) -> TrainerState | None:
    """The checkpoint to resume from (None: start at step 0), after checking it fits this run."""
    if ckpt_dir is None:
        if resume:
            raise ValueError("resume=True needs a checkpoint_dir")
        return None
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        raise ValueError(f"checkpoint_dir {ckpt_dir} is not a directory")
    saved = list_checkpoints(ckpt_dir)
    if not resume:
        if saved:
            raise ValueError(
                f"checkpoint_dir {ckpt_dir} already holds distillation checkpoints (newest: "
                f"{saved[-1][1].name}): pass resume=True to continue, or choose another directory"
            )
        return None
    if not saved:
        logger.info("no checkpoint in %s: distilling from step 0", ckpt_dir)
        return None
    state = load_trainer_state(saved[-1][1])
    where = saved[-1][1]
    current = dataclasses.asdict(config)
    differ = [
        f"{k}: saved {v!r}, now {current[k]!r}"
        for k, v in state.meta["config"].items()
        if k not in _NOT_TRAJECTORY and _jsonable(current.get(k)) != _jsonable(v)
    ]
    saved_precision = state.meta.get("precision")
    if config.precision != "auto" and saved_precision not in (None, config.precision):
        differ.append(f"precision: saved {saved_precision!r}, now {config.precision!r}")
    if differ:
        raise ValueError(f"cannot resume from {where}: the settings differ ({'; '.join(differ)})")
    if state.meta["model"] != _model_signature(model):
        raise ValueError(
            f"cannot resume from {where}: it was made for {state.meta['model']}, "
            f"this model is {_model_signature(model)}"
        )
    shapes = {name: list(p.shape) for name, p in trainable.items()}
    if state.meta["trainable"] != shapes or set(state.params) != set(shapes):
        raise ValueError(f"cannot resume from {where}: its trainable tensors do not match this model's")
    return state


def _resumed_precision(state: TrainerState | None, device: torch.device) -> str | None:
    """The precision a resumed run started with (checkpoints from before `precision` ran fp32 on CPU
    and bf16 on CUDA), so it goes on bit for bit; None for a fresh run."""
    if state is None:
        return None
    return state.meta.get("precision") or ("bf16" if device.type == "cuda" else "fp32")


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_int(name: str, value, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        must = "an int" if minimum is None else f"an int >= {minimum}"
        raise ValueError(f"DistillConfig.{name} must be {must}, got {value!r}")


def _check_float(name: str, value, must: str, ok) -> None:
    if not _is_real(value) or not ok(value):
        raise ValueError(f"DistillConfig.{name} must be a finite number {must}, got {value!r}")
