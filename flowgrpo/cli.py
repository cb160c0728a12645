"""The `flowgrpo` command."""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import warnings


def _configure_logging() -> logging.Logger:
    """Log lines on stderr (`LEVEL logger: message`), flowgrpo's own warnings shown once, as one log line each;
    returns the command's own logger (`_narrator`). Cheap: imports no model library."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if getattr(warnings.showwarning, "flowgrpo", False):  # configured already (once per process)
        return _narrator()
    recent = _RecentMessages()
    for handler in logging.getLogger().handlers:
        handler.addFilter(recent)
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        module = getattr(category, "__module__", "") or ""
        if file is None and module.split(".")[0] in ("flowgrpo", "pipelines", "reward_models"):
            text = str(message)
            if text not in recent.messages:  # an emitter that logs and warns (for filters and tests) shows once
                logging.getLogger(module).warning(text)
            return
        default(message, category, filename, lineno, file, line)

    show.flowgrpo = True  # type: ignore[attr-defined]
    warnings.showwarning = show
    return _narrator()


class _RecentMessages(logging.Filter):
    """Remembers the last messages logged, so that a warning that repeats one is not shown a second time."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: collections.deque[str] = collections.deque(maxlen=32)

    def filter(self, record: logging.LogRecord) -> bool:
        self.messages.append(record.getMessage())
        return True


class _OncePerKind(logging.Filter):
    """The tokenizers' truncation warnings: diffusers' "The following part of your input was truncated because
    CLIP can only handle sequences up to 77 tokens: [...]" comes on every prompt batch of a run with long prompts
    (and transformers adds "Token indices sequence length is longer than ..." for the untruncated ids diffusers
    asks for only to print that message). The first of each kind is shown, with a note; the rest are dropped."""

    PREFIXES = ("The following part of your input was truncated",)
    DROP = ("Token indices sequence length is longer than the specified maximum",)

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.DROP):
            return False
        if not message.startswith(self.PREFIXES):
            return True
        kind = message.split(":", 1)[0]
        if kind in self.seen:
            return False
        self.seen.add(kind)
        record.msg, record.args = f"{message} (prompts are cut to what the text encoder takes; shown once)", None
        return True


def _quiet_truncation_warnings() -> None:
    """Install _OncePerKind on the handlers that print diffusers' and transformers' warnings (their own library
    handlers, and the root's for records that propagate)."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    diffusers_logging.get_logger("diffusers")  # creates the library handlers if not there yet
    transformers_logging.get_logger("transformers")
    once = _OncePerKind()
    for name in ("diffusers", "transformers", None):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _OncePerKind) for f in handler.filters):
                handler.addFilter(once)


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


class _Stdout(logging.StreamHandler):
    """A handler on whatever sys.stdout is when a record comes (pytest's capture swaps it per test)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def _narrator() -> logging.Logger:
    """The command's own lines (what it loads) on stdout, like its closing summary: stderr stays for warnings,
    errors (one line for bad input) and the progress bar."""
    log = logging.getLogger("flowgrpo.cli")
    if not any(getattr(h, "flowgrpo_narrator", False) for h in log.handlers):
        handler = _Stdout()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.flowgrpo_narrator = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


_LIBRARIES = {"train-t2i": "torch and diffusers", "train-text": "torch and transformers"}


def _announce(args: argparse.Namespace) -> None:
    """A training command's first line, before anything slow is imported (torch alone takes seconds cold)."""
    if args.command in _LIBRARIES and _rank0():
        _configure_logging()
        _narrator().info(
            "%s %s: importing %s, then loading the model%s",
            args.command,
            args.config,
            _LIBRARIES[args.command],
            " and scorers" if args.command == "train-t2i" else "",
        )


def _cmd_demo(args: argparse.Namespace) -> int:
    from .config import load_config
    from .demo import DEFAULTS, DemoConfig, run_demo

    config = load_config(DemoConfig, args.config, args.overrides, defaults=DEFAULTS)
    history = run_demo(config)
    first, last = history[0]["reward_mean"], history[-1]["reward_mean"]
    print(
        f"reward {first:.3f} -> {last:.3f} over {len(history)} iterations; metrics in {config.output_dir}/metrics.jsonl"
    )
    return 0


def _cmd_train_text(args: argparse.Namespace) -> int:
    import math

    log = _configure_logging()
    from .text import DataError, RewardError, load_text_config, train_text
    from .text.reward_imports import reward_files_relative_to

    config = load_text_config(args.config, args.overrides)
    reward_files_relative_to(args.config)  # a relative `file.py:function` is found beside the config naming it
    if _rank0():
        log.info(
            "loading %s (%s), rewards %s; output in %s",
            "a tiny random model" if config.model.name_or_path == "tiny" else config.model.name_or_path,
            "LoRA" if config.model.lora.enabled else "full fine-tune",
            [r.label for r in config.rewards],
            config.output_dir,
        )
    try:
        history = train_text(config)
    except (DataError, RewardError) as err:
        print(f"flowgrpo: {err}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") != "0":  # one summary per run, not one per process
        return 0
    if history:
        first = history[0].get("reward_mean", math.nan)
        last = history[-1].get("reward_mean", math.nan)
        print(
            f"reward {first:.3f} -> {last:.3f} over steps {history[0]['iteration']}..{history[-1]['iteration']}; "
            f"metrics in {config.output_dir}/metrics.jsonl"
        )
    else:
        print(f"nothing to do: the run is already at step {config.iterations}")
    return 0


def _cmd_train_t2i(args: argparse.Namespace) -> int:
    import math

    log = _configure_logging()
    from .t2i import load_t2i_config, train_t2i

    _quiet_truncation_warnings()
    config = load_t2i_config(args.config, args.overrides)
    if _rank0():
        m = config.model
        log.info(
            "method %s: loading %s %s (%s), scorers %s; output in %s",
            config.method,
            m.family,
            "tiny random weights" if m.tiny else m.pretrained,
            m.finetune,
            [r.label for r in config.rewards],
            config.output_dir,
        )
    history = train_t2i(config)
    if os.environ.get("RANK", "0") != "0":  # one summary per run, not one per process
        return 0
    if history:
        from reward_models import get_entry

        pairwise = [r.label for r in config.rewards if get_entry(r.name).kind == "pairwise"]
        if pairwise:  # a group's win rates average 0.5 by construction: the pointwise rewards are what moved
            moved = [
                f"{r.label} {history[0].get(f'rewards/{r.label}/mean', math.nan):.4f} -> "
                f"{history[-1].get(f'rewards/{r.label}/mean', math.nan):.4f}"
                for r in config.rewards
                if r.label not in pairwise
            ]
            head = "; ".join([*moved, f"{', '.join(pairwise)}: pairwise, win rates average 0.5 in a group"])
        else:
            first, last = history[0].get("reward_mean", math.nan), history[-1].get("reward_mean", math.nan)
            head = f"reward {first:.4f} -> {last:.4f}"
        print(
            f"{head} over iterations {history[0]['iteration']}..{history[-1]['iteration']}; "
            f"metrics in {config.output_dir}/metrics.jsonl, grids in {config.output_dir}/grids"
        )
    else:
        print(f"nothing to do: the run is already at iteration {config.iterations}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    import json

    from . import listing

    try:
        sections = listing.select(args.sections)
    except ValueError as err:
        print(f"flowgrpo list: {err}", file=sys.stderr)
        return 2
    items = listing.entries(sections)
    text = json.dumps(listing.to_json(items), indent=2) + "\n" if args.json else listing.format_text(items)
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `flowgrpo list | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowgrpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="GRPO on a tabular token policy through the shared core (seconds, CPU)")
    demo.add_argument("--config", default=None, help="YAML file (default: the embedded demo config)")
    demo.add_argument("overrides", nargs="*", help="key=value overrides, e.g. loss.preset=gspo lr=0")
    demo.set_defaults(func=_cmd_demo)
    text = sub.add_parser("train-text", help="GRPO-family training of a causal LM (see configs/text/)")
    text.add_argument("config", help="YAML config, e.g. configs/text/tiny_pattern.yaml")
    text.add_argument("overrides", nargs="*", help="key=value overrides, e.g. loss.preset=gspo optim.lr=0")
    text.set_defaults(func=_cmd_train_text)
    t2i = sub.add_parser("train-t2i", help="RL for text-to-image models: every method a recipe (configs/t2i/)")
    t2i.add_argument("config", help="YAML recipe, e.g. configs/t2i/tiny/flow_grpo.yaml")
    t2i.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=0 iterations=5")
    t2i.set_defaults(func=_cmd_train_t2i)
    # listed for `flowgrpo --help`; `main` hands `flowgrpo evaluate / gpu-check ...` to their own parsers
    sub.add_parser("evaluate", help="score images (a folder, or generated by a model) and write a report")
    sub.add_parser("gpu-check", help="validate the GPU path with real-size random models and write a report")
    lister = sub.add_parser("list", help="every registry's entries with their settings and defaults")
    lister.add_argument("sections", nargs="*", help="only these, e.g. kernels plans (default: all)")
    lister.add_argument("--json", action="store_true", help="machine-readable output")
    lister.set_defaults(func=_cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["evaluate"]:  # its parser lives with it (argparse.REMAINDER drops leading --options)
        from .evaluation import main as evaluate_main

        return evaluate_main(argv[1:])
    if argv[:1] == ["gpu-check"]:  # scripts/gpu_check.py's parser, as for evaluate
        from .gpu_check.runner import main as gpu_check_main

        return gpu_check_main(argv[1:], invoked_as="flowgrpo gpu-check")
    args = build_parser().parse_args(argv)  # `--help` ends here: nothing below (torch) is imported for it
    _announce(args)
    from .interrupts import Interrupted

    try:
        return args.func(args)
    except Interrupted as err:
        print(f"flowgrpo: {err}", file=sys.stderr)
        return err.exit_code
    except Exception as err:
        if not isinstance(err, _one_line_errors()):
            raise
        print(f"flowgrpo: {err}", file=sys.stderr)
        return 2


def _one_line_errors() -> tuple[type[Exception], ...]:
    """The failures a run reports as one line (exit 2), imported once one happened (`flowgrpo list` stays light)."""
    from .atomic_io import WriteFailed  # a run's file that could not be written (a full disk, a read-only folder)
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .guards import NonFiniteError
    from reward_models.http_client import RemoteRewardError  # a reward server still failing after its retries

    return (ConfigError, NonFiniteError, CheckpointError, WriteFailed, RemoteRewardError)


if __name__ == "__main__":
    sys.exit(main())
