"""The `flowgrpo` command."""

from __future__ import annotations

import argparse
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from .config import load_config
    from .demo import DEFAULTS, DemoConfig, run_demo

    config = load_config(DemoConfig, args.config, args.overrides, defaults=DEFAULTS)
    history = run_demo(config)
    first, last = history[0]["reward_mean"], history[-1]["reward_mean"]
    print(f"reward {first:.3f} -> {last:.3f} over {len(history)} iterations; "
          f"metrics in {config.output_dir}/metrics.jsonl")
    return 0


def _cmd_train_text(args: argparse.Namespace) -> int:
    import logging
    import math

    from .text import DataError, RewardError, load_text_config, train_text

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = load_text_config(args.config, args.overrides)
    try:
        history = train_text(config)
    except (DataError, RewardError) as err:
        print(f"flowgrpo: {err}", file=sys.stderr)
        return 2
    if history:
        first = history[0].get("reward_mean", math.nan)
        last = history[-1].get("reward_mean", math.nan)
        print(f"reward {first:.3f} -> {last:.3f} over steps {history[0]['step']}..{history[-1]['step']}; "
              f"metrics in {config.output_dir}/metrics.jsonl")
    else:
        print(f"nothing to do: the run is already at step {config.steps}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from . import core

    slots = {
        "advantage estimators": core.ESTIMATORS, "advantage transforms": core.TRANSFORMS,
        "ratios": core.RATIOS, "bounds": core.BOUNDS, "surrogates": core.SURROGATES,
        "aggregations": core.AGGREGATIONS, "KL estimators": core.KL_ESTIMATORS,
        "step weightings": core.STEP_WEIGHTINGS,
    }
    for title, registry in slots.items():
        print(f"{title}:")
        for name, doc in registry.describe().items():
            settings = registry.get(name).settings
            shown = ", ".join(f"{k}={v!r}" for k, v in settings.items())
            print(f"  {name:24s} {doc}" + (f"  [{shown}]" if shown else ""))
    print("loss presets: " + ", ".join(sorted(core.PRESETS)))
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
    lister = sub.add_parser("list", help="every registered estimator, transform and loss part")
    lister.set_defaults(func=_cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"flowgrpo: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
