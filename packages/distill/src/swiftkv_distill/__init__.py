"""swiftkv_distill: SwiftKV weights for a plain Llama / Mistral / Qwen2 checkpoint, on one machine.

Modules (one concept each):
    batch      `Batch`: right-padded sequences with the answer tokens marked
    forward    `training_forward`: the differentiable dense forward (teacher and SwiftKV paths)
    calibrate  `calibrate` (`collect_statistics`, then `fit`), `CalibrationStatistics`, `Accumulator`:
               the closed-form ridge fit of k/v_proj_swiftkv
    export     `export_student`: the student as a Hugging Face directory
    data       `Example`, `builtin_prompts`, `generate_teacher_data`, `load_jsonl`, `split_holdout`,
               `split_folds`, `batches`: the teacher's own answers (or the user's JSONL), the held-out
               split or cross-validation folds, batching
    distill    `DistillConfig`, `distill`: Snowflake's distillation of the SwiftKV parameters
    evaluate   `evaluate`, `EvalResult`: the student against the teacher on held-out data
    report     `format_table`, `write_report`: the evaluation as a table, JSON and a plot
    pipeline   `DistillSettings`, `run_distill`, `cached_student`: `swiftkv distill` end to end
    cli        `swiftkv distill` / `swiftkv eval` (`python -m swiftkv_distill`)

    teacher = swiftkv_reference.checkpoint.load_model(teacher_dir)
    config, state = calibrate(teacher, batches, num_key_value_layers=15)
    export_student(out_dir, config, state, teacher_dir)
"""

from .batch import Batch
from .calibrate import (
    DEFAULT_RIDGE,
    Accumulator,
    CalibrationError,
    CalibrationStatistics,
    calibrate,
    collect_statistics,
    fit,
)
from .data import (
    Example,
    batches,
    builtin_prompts,
    generate_teacher_data,
    load_jsonl,
    split_folds,
    split_holdout,
)
from .distill import DistillConfig, DistillResult, distill
from .evaluate import EvalResult, evaluate
from .export import export_student
from .forward import ForwardOutput, training_forward
from .pipeline import DistillReport, DistillSettings, cached_student, run_distill

__all__ = [
    "DEFAULT_RIDGE",
    "Accumulator",
    "Batch",
    "CalibrationError",
    "CalibrationStatistics",
    "DistillConfig",
    "DistillReport",
    "DistillResult",
    "DistillSettings",
    "EvalResult",
    "Example",
    "ForwardOutput",
    "batches",
    "builtin_prompts",
    "cached_student",
    "calibrate",
    "collect_statistics",
    "distill",
    "evaluate",
    "export_student",
    "fit",
    "generate_teacher_data",
    "load_jsonl",
    "run_distill",
    "split_folds",
    "split_holdout",
    "training_forward",
]
