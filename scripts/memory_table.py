"""Write the per-rank memory table of docs/scaling.md: python scripts/memory_table.py [--check]

Builds FLUX.1-dev, SD3.5-Medium, Qwen-Image, the editing models FLUX.1-Kontext-dev and Qwen-Image-Edit / -Edit-2509,
FLUX.2-klein-4B / 9B, Z-Image-Turbo and Qwen2.5-7B at full size on the meta device (no weights, no GPU, no download), checks their parameter counts against the published sizes, and
replaces the block between the memory-table markers of docs/scaling.md. --check only reports
whether the document is up to date (exit 1 if not).
"""

import argparse
import sys
from pathlib import Path

from flowgrpo.scaling.memory import (
    SPECS,
    check_counts,
    memory_table,
    model_facts,
    render_markdown,
    replace_table,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "scaling.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/scaling.md is out of date")
    parser.add_argument("--doc", type=Path, default=DOC)
    args = parser.parse_args(argv)
    facts = [model_facts(spec) for spec in SPECS]
    check_counts(facts)
    table = render_markdown(SPECS, facts, memory_table(facts))
    old = args.doc.read_text()
    new = replace_table(old, table)
    if args.check:
        if new != old:
            print(f"{args.doc} is out of date: run python scripts/memory_table.py", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(new)
    print(f"wrote the memory table of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
