"""How closely a student answers like its teacher, on held-out examples (`swiftkv eval`, and the end of
`swiftkv distill`).

Teacher-forced, at the positions whose logits predict an answer token (`Batch.logits_mask`), with
`training_forward` (teacher: swiftkv=False; student: its SwiftKV path, or its only path when L == N):

    top1_agreement   share of positions where argmax(student) == argmax(teacher)
    kl               mean KL(teacher || student) per position, in nats
    *_perplexity     exp(mean negative log-likelihood of the held-out answer tokens), for each model

and free-running: `greedy_agreement`, the share of distinct held-out prompts whose first `greedy_tokens`
greedy tokens (fewer when EOS ends both) are identical for the two models. Greedy decoding runs in
swiftkv_fast (`LLM.from_state_dict`, much faster) when it is installed, else the reference's `generate`.

    result = evaluate(teacher, student, heldout)
    print(result.top1_agreement, result.kl)
    path.write_text(result.to_json())
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from swiftkv_reference.model import SwiftKVForCausalLM

from .data import Example, batches
from .forward import training_forward

logger = logging.getLogger(__name__)

DEFAULT_GREEDY_TOKENS = 32
DEFAULT_EVAL_BATCH_TOKENS = 2048
_STATS_ROWS = 256  # positions per chunk of the per-position statistics (bounds (rows, vocab) temporaries)


@dataclass
class EvalResult:
    num_examples: int
    num_answer_tokens: int  # scored positions
    top1_agreement: float
    kl: float  # mean KL(teacher || student) per scored position, nats
    teacher_perplexity: float
    student_perplexity: float
    greedy_agreement: float | None  # None when greedy_tokens == 0
    num_greedy_prompts: int  # distinct held-out prompts decoded greedily
    greedy_tokens: int
    num_hidden_layers: int  # the student's N, L and G
    num_key_value_layers: int
    key_value_group_size: int

    def __post_init__(self) -> None:
        for name in ("num_examples", "num_answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_greedy_prompts", "greedy_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("top1_agreement", "greedy_agreement"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if not self.kl >= 0:
            raise ValueError(f"kl must be >= 0, got {self.kl}")
        for name in ("teacher_perplexity", "student_perplexity"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (self.greedy_agreement is None) != (self.greedy_tokens == 0):
            raise ValueError("greedy_agreement is None exactly when greedy_tokens == 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def pooled(cls, results: Sequence[EvalResult]) -> EvalResult:
        """The result of scoring the union of disjoint data sets (folds) scored one by one: agreement,
        KL and log-perplexities weighted by answer tokens, greedy agreement by greedy prompts. The
        results must be of the same student shape (N, L, G) and greedy length."""
        if not results:
            raise ValueError("nothing to pool")
        first = results[0]
        shape = (first.num_hidden_layers, first.num_key_value_layers, first.key_value_group_size)
        for r in results:
            if (r.num_hidden_layers, r.num_key_value_layers, r.key_value_group_size) != shape:
                raise ValueError("pooled results must be of one student shape (N, L, G)")
            if r.greedy_tokens != first.greedy_tokens:
                raise ValueError("pooled results must decode the same number of greedy tokens")
        tokens = sum(r.num_answer_tokens for r in results)

        def mean(values) -> float:
            return sum(v * r.num_answer_tokens for v, r in zip(values, results)) / tokens

        greedy_prompts = sum(r.num_greedy_prompts for r in results)
        greedy = None
        if first.greedy_tokens:
            weighted = sum(r.greedy_agreement * r.num_greedy_prompts for r in results)
            greedy = weighted / greedy_prompts if greedy_prompts else 0.0
        return cls(
            num_examples=sum(r.num_examples for r in results),
            num_answer_tokens=tokens,
            top1_agreement=mean(r.top1_agreement for r in results),
            kl=mean(r.kl for r in results),
            teacher_perplexity=math.exp(mean(math.log(r.teacher_perplexity) for r in results)),
            student_perplexity=math.exp(mean(math.log(r.student_perplexity) for r in results)),
            greedy_agreement=greedy,
            num_greedy_prompts=greedy_prompts,
            greedy_tokens=first.greedy_tokens,
            num_hidden_layers=first.num_hidden_layers,
            num_key_value_layers=first.num_key_value_layers,
            key_value_group_size=first.key_value_group_size,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalResult:
        names = {f.name for f in fields(cls)}
        missing, unknown = names - set(data), set(data) - names
        if missing or unknown:
            raise ValueError(f"EvalResult fields: missing {sorted(missing)}, unknown {sorted(unknown)}")
        return cls(**data)


def evaluate(
    teacher: SwiftKVForCausalLM,
    student: SwiftKVForCausalLM,
    heldout: Sequence[Example],
    *,
    llm_factory: Callable[..., Any] | None = None,
    greedy_tokens: int = DEFAULT_GREEDY_TOKENS,
    batch_tokens: int = DEFAULT_EVAL_BATCH_TOKENS,
) -> EvalResult:
    """Compare `student` with `teacher` (a plain model, L == N) on `heldout` (see the module docstring).
    Each model runs on its own device, without gradients, in eval mode (restored after).
    llm_factory(config, state_dict) -> swiftkv_fast.LLM builds the greedy engines (None:
    LLM.from_state_dict on the model's device when swiftkv_fast is installed, else the reference).
    greedy_tokens=0 skips the greedy comparison."""
    if teacher.config.is_swiftkv:
        raise ValueError(
            f"the teacher must be the plain model (L == N), got L={teacher.config.num_key_value_layers} "
            f"of N={teacher.config.num_hidden_layers}"
        )
    vocab = teacher.config.vocab_size
    if vocab != student.config.vocab_size:
        raise ValueError(f"teacher and student vocabularies differ: {vocab} vs {student.config.vocab_size}")
    if not heldout:
        raise ValueError("no held-out examples to evaluate on")
    if isinstance(greedy_tokens, bool) or not isinstance(greedy_tokens, int) or greedy_tokens < 0:
        raise ValueError(f"greedy_tokens must be an int >= 0, got {greedy_tokens!r}")
    for e in heldout:
        if max(e.token_ids) >= vocab:
            raise ValueError(f"an example has token id {max(e.token_ids)} >= vocab_size {vocab}")
    packed = batches(heldout, batch_tokens)
    student_swiftkv = student.config.is_swiftkv

    modes = (teacher.training, student.training)
    teacher.eval(), student.eval()
    try:
        sums = torch.zeros(4, dtype=torch.float64)  # agree, kl, teacher nll, student nll
        num_positions = 0
        with torch.no_grad():
            for batch in packed:
                mask = batch.logits_mask  # (B, T)
                targets = batch.input_ids.roll(-1, dims=1)[mask]  # (P,) the answer token each predicts
                t_logits = _logits(teacher, batch, swiftkv=False)  # (P, V) fp32
                s_logits = _logits(student, batch, swiftkv=student_swiftkv).to(t_logits.device)
                sums += position_stats(t_logits, s_logits, targets.to(t_logits.device))
                num_positions += int(mask.sum())
    finally:
        teacher.train(modes[0])
        student.train(modes[1])
    if num_positions == 0:
        raise ValueError("the held-out examples have no answer tokens to score")
    agree, kl, t_nll, s_nll = (float(x) / num_positions for x in sums)

    greedy, num_prompts = None, 0
    if greedy_tokens:
        prompts = list(dict.fromkeys(e.prompt_token_ids for e in heldout))
        num_prompts = len(prompts)
        want = greedy_continuations(teacher, prompts, greedy_tokens, llm_factory=llm_factory)
        got = greedy_continuations(student, prompts, greedy_tokens, llm_factory=llm_factory)
        greedy = sum(a == b for a, b in zip(want, got)) / num_prompts
    cfg = student.config
    result = EvalResult(
        num_examples=len(heldout),
        num_answer_tokens=num_positions,
        top1_agreement=agree,
        kl=max(kl, 0.0),
        teacher_perplexity=_perplexity(t_nll),
        student_perplexity=_perplexity(s_nll),
        greedy_agreement=greedy,
        num_greedy_prompts=num_prompts,
        greedy_tokens=greedy_tokens,
        num_hidden_layers=cfg.num_hidden_layers,
        num_key_value_layers=cfg.num_key_value_layers,
        key_value_group_size=cfg.key_value_group_size,
    )
    logger.info(
        "held-out (%d examples, %d answer tokens): top-1 agreement %.4f, KL %.4f, perplexity teacher %.3f "
        "student %.3f, greedy agreement %s",
        result.num_examples,
        result.num_answer_tokens,
        result.top1_agreement,
        result.kl,
        result.teacher_perplexity,
        result.student_perplexity,
        "-" if greedy is None else f"{greedy:.3f} of {num_prompts} prompts",
    )
    return result


def _perplexity(nll: float) -> float:
    return math.exp(nll) if nll < 709 else math.inf  # math.exp overflows past ~709.78


def _logits(model: SwiftKVForCausalLM, batch, swiftkv: bool) -> torch.Tensor:
    batch = batch.to(next(model.parameters()).device)
    ids, mask = batch.input_ids, batch.logits_mask
    return training_forward(model, ids, swiftkv=swiftkv, logits_mask=mask, scored_only=swiftkv).logits


def position_stats(t_logits: torch.Tensor, s_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sums over positions of [top-1 agreement, KL(teacher || student), teacher NLL, student NLL]
    (fp64 (4,)); t_logits, s_logits: (P, vocab); targets: (P,) the token each position predicts."""
    sums = torch.zeros(4, dtype=torch.float64)
    for start in range(0, t_logits.shape[0], _STATS_ROWS):
        rows = slice(start, start + _STATS_ROWS)
        t = torch.log_softmax(t_logits[rows].float(), dim=-1)  # (p, V)
        s = torch.log_softmax(s_logits[rows].float(), dim=-1)
        y = targets[rows, None]  # (p, 1)
        sums += torch.stack(
            [
                (t.argmax(-1) == s.argmax(-1)).double().sum(),
                (t.exp() * (t - s)).sum(-1).double().sum(),
                -t.gather(-1, y).double().sum(),
                -s.gather(-1, y).double().sum(),
            ]
        ).cpu()
    return sums


def greedy_continuations(
    model: SwiftKVForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    llm_factory: Callable[..., Any] | None = None,
) -> list[list[int]]:
    """The greedy tokens (up to max_tokens; EOS included when it ends them) after each prompt, on the
    model's own path (SwiftKV when L < N). swiftkv_fast when installed (llm_factory, or
    LLM.from_state_dict on the model's device), else the reference's generate."""
    try:
        from swiftkv_fast import LLM, SamplingParams
    except ImportError:
        if llm_factory is not None:
            raise
        return _reference_greedy(model, prompts, max_tokens)
    device = next(model.parameters()).device
    state = {k: v.detach() for k, v in model.state_dict().items()}
    config = model.config.replace(swiftkv=True)  # the engine serves a model's own path
    if llm_factory is None:
        llm = LLM.from_state_dict(config, state, device=str(device))
    else:
        llm = llm_factory(config, state)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts],
            SamplingParams(temperature=0, max_tokens=max_tokens),
            use_tqdm=False,
        )
    finally:
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next engine sizes its KV cache from the free memory
    return [list(o.outputs[0].token_ids) for o in outs]


def _reference_greedy(model, prompts, max_tokens: int) -> list[list[int]]:
    from swiftkv_reference.generate import generate
    from swiftkv_reference.sampling import SamplingSettings

    logger.info("swiftkv_fast is not installed: greedy decoding with the (slower) reference")
    settings = SamplingSettings(temperature=0.0, max_tokens=max_tokens)
    prompts = [list(p) for p in prompts]
    return [g.token_ids for g in generate(model, prompts, settings, swiftkv=model.config.is_swiftkv)]
