"""Evaluate images with reward models: a folder of images, or images generated now by a model (with
or without LoRA); per-image scores (CSV, JSONL), summary statistics with bootstrap intervals, a
comparison of two runs (mean difference, win rate) and a self-contained HTML report.

    from flowgrpo.evaluation import main
    main(["--images", "samples/", "--scorers", "pickscore,aesthetic", "-o", "outputs/eval/samples"])

Modules: config (the strict config), sources (prompt files, image folders), generate (ODE sampling
with a model adapter), scoring (reward_models scorers), stats (summary, bootstrap, win rate),
results (the files of a run), report (HTML), runner (the whole evaluation and the command line).
"""

from .config import EvalConfig, GenerateInput, ImagesInput, InputConfig, load_eval_config
from .results import Run, read_run
from .runner import add_arguments, build_parser, evaluate, main, run_from_args
from .sources import EvaluationError, Sample

__all__ = [
    "EvalConfig", "EvaluationError", "GenerateInput", "ImagesInput", "InputConfig", "Run", "Sample",
    "add_arguments", "build_parser", "evaluate", "load_eval_config", "main", "read_run", "run_from_args",
]  # fmt: skip
