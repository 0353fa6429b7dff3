"""`swiftkv distill` end to end: data -> calibration -> (distillation) -> evaluation -> export.

    settings = DistillSettings(num_key_value_layers=15)
    report = run_distill(teacher_dir, out_dir, settings)          # teacher_dir None: the embedded model
    path = cached_student(teacher_dir, settings)                  # the same, cached under the user cache

Every setting, the output directory, the checkpoint flags and the data file are checked before the
teacher answers its first prompt. The held-out share of the data (data.split_holdout) is never
calibrated or trained on; the evaluation runs on it and is written next to the checkpoint (`eval.json`,
`eval.png`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from swiftkv_reference.checkpoint import (
    TOKENIZER_FILES,
    check_conversion_paths,
    load_config,
    load_model,
    stored_dtype,
)
from swiftkv_reference.config import SwiftKVConfig
from swiftkv_reference.model import SwiftKVForCausalLM

from .calibrate import CALIBRATION_VERSION, DEFAULT_RIDGE, DEFAULT_WEIGHTING, WEIGHTINGS, calibrate
from .data import (
    DEFAULT_HOLDOUT_SHARE,
    DEFAULT_NUM_SAMPLES,
    DEFAULT_TEMPERATURE,
    Example,
    batches,
    builtin_prompts,
    builtin_prompts_fingerprint,
    generate_teacher_data,
    load_jsonl,
    split_holdout,
)
from .distill import DistillConfig, TeacherCache, distill
from .evaluate import EvalResult, evaluate
from .export import as_exported, export_student
from .precision import check_precision, resolve_precision
from .report import format_table, write_report
from .trainer_state import list_checkpoints

logger = logging.getLogger(__name__)


# settings that do not reach a calibration-only student, left out of its cache key (lr stays in it, as it
# always has: leaving it out now would orphan the students cached so far)
DISTILLATION_ONLY = ("logits_loss_temp", "hidden_loss_mult")


@dataclass(frozen=True)
class DistillSettings:
    """What `swiftkv distill` does; checked on construction, each error naming its field."""

    num_key_value_layers: int  # L: layers >= L take their K/V from layer L's input
    key_value_group_size: int = 1  # G: AcrossKV, G consecutive layers >= L share one KV cache
    num_samples: int = DEFAULT_NUM_SAMPLES  # teacher answers to the built-in prompts (without a data file)
    max_tokens: int = 256  # longest teacher answer
    temperature: float = DEFAULT_TEMPERATURE  # the teacher's sampling temperature
    holdout_share: float = DEFAULT_HOLDOUT_SHARE  # of the prompts, kept for evaluation only
    batch_tokens: int = 2048  # tokens (padding included) per calibration / training batch
    ridge: float = DEFAULT_RIDGE
    weighting: str = DEFAULT_WEIGHTING  # calibration rows: "attention" (each key's attention) or "uniform"
    calibration_samples: int | None = None  # calibrate on the first this many training examples (None: all)
    steps: int = 0  # distillation steps after the calibration (0: calibration only)
    lr: float = 2e-4
    logits_loss_temp: float = 2.0  # distillation: the KL's temperature (Snowflake's 2)
    hidden_loss_mult: float = 1.0  # distillation: weight of the hidden-state MSE (Snowflake's 1; 0: KL only)
    precision: str = "auto"  # "fp32", "bf16" or "auto" (measured): the teacher's passes and the steps
    greedy_tokens: int = 32  # greedy agreement over this many tokens per held-out prompt
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        ints = {"num_key_value_layers": 1, "key_value_group_size": 1, "num_samples": 2, "max_tokens": 1}
        ints |= {"batch_tokens": 2, "steps": 0, "greedy_tokens": 0, "seed": 0}
        if self.calibration_samples is not None:
            ints["calibration_samples"] = 1
        for name, minimum in ints.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        for name, ok, must in (
            ("temperature", lambda x: x > 0, "> 0"),
            ("holdout_share", lambda x: 0 < x < 1, "in (0, 1)"),
            ("ridge", lambda x: x >= 0, ">= 0"),
            ("lr", lambda x: x > 0, "> 0"),
            ("logits_loss_temp", lambda x: x > 0, "> 0"),
            ("hidden_loss_mult", lambda x: x >= 0, ">= 0"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number {must}, got {value!r}")
            if not ok(value):
                raise ValueError(f"{name} must be {must}, got {value!r}")
        check_precision(self.precision)
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}") from e
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}, but this machine has no CUDA; use 'cpu'")

    def student_config(self, teacher: SwiftKVConfig) -> SwiftKVConfig:
        """The student's config; ValueError when L, G do not fit the teacher."""
        if teacher.is_swiftkv:
            raise ValueError(
                f"the teacher is already a SwiftKV model (L={teacher.num_key_value_layers}); "
                "distill from the plain model"
            )
        n = teacher.num_hidden_layers
        if not 1 <= self.num_key_value_layers < n:
            raise ValueError(f"num_key_value_layers must be in [1, {n}) for this {n}-layer model")
        if (n - self.num_key_value_layers) % self.key_value_group_size:
            raise ValueError(
                f"key_value_group_size={self.key_value_group_size} must divide num_hidden_layers - "
                f"num_key_value_layers = {n - self.num_key_value_layers}"
            )
        return teacher.replace(
            model_type=f"{teacher.family}_swiftkv",
            num_key_value_layers=self.num_key_value_layers,
            key_value_group_size=self.key_value_group_size,
            swiftkv=True,
        )

    def distill_config(self) -> DistillConfig:
        """The distillation these settings run (ValueError without steps)."""
        if not self.steps:
            raise ValueError("steps is 0: these settings run no distillation")
        return DistillConfig(
            steps=self.steps,
            lr=self.lr,
            logits_loss_temp=self.logits_loss_temp,
            hidden_loss_mult=self.hidden_loss_mult,
            precision=self.precision,
        )

    def cache_key(self) -> dict:
        """What determines the student (not the device, which only changes the speed, nor the
        distillation's settings without distillation), and the calibration's version (a student
        cached by an earlier fit is refitted)."""
        unused = {"device"} | (set(DISTILLATION_ONLY) if self.steps == 0 else set())
        if self.calibration_samples is None:  # all: the cache key every student had before the setting
            unused.add("calibration_samples")
        key = {k: v for k, v in asdict(self).items() if k not in unused}
        return key | {"calibration": CALIBRATION_VERSION}


@dataclass
class DistillReport:
    out_dir: Path
    config: SwiftKVConfig
    num_train_examples: int
    num_heldout_examples: int
    num_train_tokens: int
    results: dict[str, EvalResult] = field(default_factory=dict)  # "calibrated" / "distilled"
    seconds: dict[str, float] = field(default_factory=dict)  # per stage


def resolve_teacher_dir(teacher_dir: str | os.PathLike | None) -> Path:
    if teacher_dir is None:
        from swiftkv_reference.default_model import default_model_dir

        return default_model_dir()
    path = Path(teacher_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"teacher checkpoint directory {str(path)!r} does not exist")
    return path


def load_teacher_tokenizer(teacher_dir: Path):
    """The teacher's tokenizer; a ValueError naming the directory when it has none."""
    from swiftkv_reference.tokenizer import load_tokenizer

    try:
        return load_tokenizer(teacher_dir)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load the tokenizer of {str(teacher_dir)!r} (the data needs its tokenizer files): {e}"
        ) from e


def check_checkpoint_flags(
    settings: DistillSettings, checkpoint_dir: str | os.PathLike | None, resume: bool
) -> None:
    """What `distill` would refuse only after the data and the calibration, refused before them."""
    if (checkpoint_dir is not None or resume) and not settings.steps:
        raise ValueError(
            "checkpoint_dir / resume (--checkpoint-dir, --resume) need distillation steps (--steps N)"
        )
    if checkpoint_dir is None:
        if resume:
            raise ValueError("resume (--resume) needs a checkpoint_dir (--checkpoint-dir)")
        return
    path = Path(checkpoint_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint_dir {str(path)!r} is not a directory")
    saved = list_checkpoints(path)
    if saved and not resume:
        raise ValueError(
            f"checkpoint_dir {str(path)!r} already holds distillation checkpoints (newest: "
            f"{saved[-1][1].name}): pass resume (--resume) to continue, or choose another directory"
        )


def load_examples(
    teacher_dir: Path,
    settings: DistillSettings,
    data_path: str | os.PathLike | None,
    tokenizer,
    precision: str = "fp32",
) -> list[Example]:
    """The user's JSONL, or the teacher's own answers to the built-in prompts (fast engine). precision
    (resolved): with "bf16" the engine may run its fp32 products as bf16x3 where it measures that faster
    (matmul_precision "high": Intel AMX; about fp32's accuracy), which samples the same distribution."""
    if data_path is not None:
        return load_jsonl(data_path, tokenizer)
    from swiftkv_fast import LLM

    llm = LLM(
        str(teacher_dir),
        tokenizer=tokenizer,
        device=settings.device,
        max_model_len=min(2048, load_config(teacher_dir).max_position_embeddings),
        seed=settings.seed,
        matmul_precision="high" if precision == "bf16" else "highest",
    )
    return generate_teacher_data(
        llm,
        builtin_prompts(),
        num_samples=settings.num_samples,
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        seed=settings.seed,
    )


def run_distill(
    teacher_dir: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    settings: DistillSettings,
    *,
    data_path: str | os.PathLike | None = None,
    overwrite: bool = False,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
) -> DistillReport:
    """Calibrate (and with settings.steps, distill) a SwiftKV student of the teacher; evaluate it on
    the held-out data; write it to out_dir (atomically, with eval.json / eval.png beside it)."""
    teacher_dir = resolve_teacher_dir(teacher_dir)
    out_dir = Path(out_dir)
    student_config = settings.student_config(load_config(teacher_dir))  # L and G fit the teacher
    check_conversion_paths(teacher_dir.resolve(), out_dir.resolve(), overwrite)
    check_checkpoint_flags(settings, checkpoint_dir, resume)
    tokenizer = load_teacher_tokenizer(teacher_dir)
    dtype = stored_dtype(teacher_dir)  # what the student is written in: the teacher's own
    seconds: dict[str, float] = {}

    t = time.perf_counter()
    if data_path is not None:  # the user's data is read and split (or refused) before any other work
        examples = load_jsonl(data_path, tokenizer)
        train, heldout = split_holdout(examples, share=settings.holdout_share, seed=settings.seed)
    seconds["data"] = time.perf_counter() - t
    teacher = load_model(teacher_dir).to(settings.device)
    # the data, calibration's pass and the steps run in it: measured before the teacher writes its data
    precision = resolve_precision(settings.precision, teacher, torch.device(settings.device))
    if data_path is None:
        t = time.perf_counter()
        examples = load_examples(teacher_dir, settings, None, tokenizer, precision)
        train, heldout = split_holdout(examples, share=settings.holdout_share, seed=settings.seed)
        seconds["data"] += time.perf_counter() - t
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    fit_examples = train[: settings.calibration_samples]  # None: all
    logger.info(
        "%d training / %d held-out examples; calibrating on %d", len(train), len(heldout), len(fit_examples)
    )

    t = time.perf_counter()
    train_batches = batches(train, settings.batch_tokens, pad, seed=settings.seed) if settings.steps else None
    teacher_cache, keep_states, on_batch = None, (), None
    if train_batches is not None:  # calibration's teacher pass also gives distillation's first epoch
        teacher_cache = TeacherCache(student_config, settings.distill_config())
        teacher_cache.expect(train_batches)
        keep_states = teacher_cache.keep_states

        def on_batch(batch, out):
            teacher_cache.offer(teacher, batch, out)

    config, state = calibrate(
        teacher,
        batches(fit_examples, settings.batch_tokens, pad),
        settings.num_key_value_layers,
        settings.key_value_group_size,
        ridge=settings.ridge,
        weighting=settings.weighting,
        keep_states=keep_states,
        on_batch=on_batch,
        precision=precision,
    )
    seconds["calibrate"] = time.perf_counter() - t
    student = _model(config, state, settings.device)
    results, ran = {}, {"resolved_precision": precision}
    if settings.steps:
        results["calibrated"] = _evaluate(teacher, student, heldout, settings)
        t = time.perf_counter()
        ran["distill_precision"] = distill(  # what "auto" resolved to
            student,
            train_batches,
            settings.distill_config(),
            checkpoint_dir=checkpoint_dir,
            resume=resume,
            device=settings.device,
            teacher_cache=teacher_cache,
        ).precision
        del teacher_cache
        seconds["distill"] = time.perf_counter() - t
        state = {k: v.detach().cpu() for k, v in student.state_dict().items()}
    if dtype != torch.float32:  # score the weights as the checkpoint will hold them
        state = {k: v.float() if v.is_floating_point() else v for k, v in as_exported(state, dtype).items()}
        student.load_state_dict(state)
    t = time.perf_counter()
    results["distilled" if settings.steps else "calibrated"] = _evaluate(teacher, student, heldout, settings)
    seconds["evaluate"] = time.perf_counter() - t
    export_student(out_dir, config, state, teacher_dir, overwrite=overwrite, dtype=dtype)
    report = DistillReport(
        out_dir,
        config,
        len(train),
        len(heldout),
        sum(len(e) for e in train),
        results,
        seconds,
    )
    write_report(out_dir, results, name="eval", settings=settings.cache_key() | ran, seconds=seconds)
    logger.info("\n%s", format_table(results))
    return report


def _model(config: SwiftKVConfig, state: dict[str, torch.Tensor], device: str) -> SwiftKVForCausalLM:
    model = SwiftKVForCausalLM(config)
    model.load_state_dict(state)
    return model.to(device).eval()


def _evaluate(teacher, student, heldout: list[Example], settings: DistillSettings) -> EvalResult:
    return evaluate(teacher, student, heldout, greedy_tokens=settings.greedy_tokens)


def teacher_fingerprint(teacher_dir: Path) -> str:
    """sha256 over the teacher's config, weight and tokenizer files (names, sizes and bytes): the
    tokenizer's chat template shapes the teacher's data, so it shapes the student too."""
    digest = hashlib.sha256()
    names = {"config.json", *TOKENIZER_FILES}
    files = sorted(p for p in teacher_dir.iterdir() if p.name in names or p.suffix == ".safetensors")
    for path in files:
        digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def cached_student(
    teacher_dir: str | os.PathLike | None,
    settings: DistillSettings,
    cache_root: str | os.PathLike | None = None,
) -> tuple[Path, bool]:
    """The student for (teacher, settings), distilled once and kept under the user cache directory
    (`swiftkv_reference.default_model.cache_dir()/students/<key>`), keyed by a hash of the teacher's
    files, of the built-in prompts and of the settings. -> (directory, True when it was already there).
    After a new one is fitted, the least recently used beyond STUDENTS_KEPT are removed (prune_students)."""
    from swiftkv_reference.default_model import cache_dir

    teacher_dir = resolve_teacher_dir(teacher_dir)
    key_text = json.dumps(
        {
            "teacher": teacher_fingerprint(teacher_dir),
            "prompts": builtin_prompts_fingerprint(),
            **settings.cache_key(),
        },
        sort_keys=True,
    )
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    root = Path(cache_root) if cache_root is not None else cache_dir() / "students"
    path = root / f"L{settings.num_key_value_layers}-G{settings.key_value_group_size}-{key}"
    if (path / "config.json").is_file() and (path / "eval.json").is_file():
        os.utime(path)  # used now: the order prune_students keeps by
        return path, True
    root.mkdir(parents=True, exist_ok=True)
    run_distill(teacher_dir, path, settings, overwrite=True)
    prune_students(root, keep=STUDENTS_KEPT, protect=path)
    return path, False


# cached students kept under the user cache: after a new one is fitted, the least recently used beyond
# this many are removed (each ~0.5 GiB for the embedded model; a new package version, teacher, prompt
# set or setting makes a new key, and an old key is then never looked up again)
STUDENTS_KEPT = 3
_STUDENT_NAME = re.compile(r"L\d+-G\d+-[0-9a-f]{16}")
_REMOVING = re.compile(r"\.L\d+-G\d+-[0-9a-f]{16}\.removing-[0-9a-f]{8}")  # a removal cut short


def prune_students(
    root: str | os.PathLike, keep: int, protect: str | os.PathLike | None = None
) -> list[Path]:
    """Removes all but the `keep` most recently used students under `root` (by directory mtime, which
    cached_student refreshes on every hit); `protect` stays whatever its age. Only directories named
    as cached_student names them are touched. -> the removed directories, logged with the space freed.

    Example: students A (used Monday), B (Tuesday), C (Wednesday) and a new D with keep=3 -> A goes."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    protect = Path(protect).resolve() if protect is not None else None
    students = []  # (protected, last used, path)
    for p in Path(root).iterdir():
        if p.is_dir() and _REMOVING.fullmatch(p.name):
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_dir() and _STUDENT_NAME.fullmatch(p.name):
            try:
                students.append((p.resolve() == protect, p.stat().st_mtime, p))
            except OSError:  # removed meanwhile (another process pruning)
                continue
    students.sort(reverse=True)  # `protect` first, then the most recently used
    removed, freed = [], 0
    for _, _, path in students[keep:]:
        # renamed out of the student names first: an interrupted removal never leaves a directory that
        # cached_student would take for a complete student
        trash = path.with_name(f".{path.name}.removing-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, trash)
            freed += sum(f.stat().st_size for f in trash.rglob("*") if f.is_file())
            shutil.rmtree(trash)
        except OSError as e:  # e.g. another process removing it too: the cache stays usable
            logger.warning("could not remove the cached student %s: %s", path, e)
            continue
        removed.append(path)
    if removed:
        logger.info(
            "removed %d cached student(s) not used recently (%s; %.0f MiB), keeping the %d most recent in %s",
            len(removed),
            ", ".join(p.name for p in removed),
            freed / 2**20,
            keep,
            root,
        )
    return removed
