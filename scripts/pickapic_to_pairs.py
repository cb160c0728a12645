"""Pick-a-Pic rows -> the offline preference pairs of `method: diffusion_dpo` (`dpo.data`).

Reads Pick-a-Pic v1 / v2 rows (yuvalkirstain/pickapic_v2's parquet shards, or .jsonl rows with the same columns and
the images as base64 strings): `caption`, `jpg_0`, `jpg_1` (encoded image bytes) and `label_0` (1: image 0
preferred, 0: image 1 preferred, 0.5: no decision). As DiffusionDPO's train.py (SalesforceAIResearch/DiffusionDPO @
5233e75: "eliminate no-decisions", `if label_0 == 0: im_tup = im_tup[::-1]`), rows whose label_0 is not 0 or 1 are
dropped and the preferred image is the chosen one. Writes OUT/images/<n>_{chosen,rejected}.<ext> (the bytes as
stored) and OUT/pairs.jsonl, one {"prompt", "chosen", "rejected"} a line, paths relative to OUT:

    python scripts/pickapic_to_pairs.py data/pickapic_v2/train-*.parquet --out data/pickapic_pairs
    # then: dpo: {data: data/pickapic_pairs/pairs.jsonl}

Parquet needs pyarrow (pip install pyarrow); .jsonl needs nothing beyond the standard library and PIL.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from pathlib import Path
from typing import Any, Iterator

COLUMNS = ("caption", "jpg_0", "jpg_1", "label_0")


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of one .parquet or .jsonl file (only the four columns used)."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256, columns=list(COLUMNS)):
            yield from batch.to_pylist()
    elif path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
    else:
        raise SystemExit(f"{path}: expected a .parquet or .jsonl file, got suffix '{path.suffix}'")


def _image_bytes(value: Any, where: str) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict) and isinstance(value.get("bytes"), (bytes, bytearray)):  # datasets' Image feature
        return bytes(value["bytes"])
    if isinstance(value, str):
        return base64.b64decode(value)
    raise SystemExit(f"{where}: image column holds {type(value).__name__}; expected bytes or a base64 string")


def _extension(data: bytes, where: str) -> str:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = (im.format or "").lower()
    except OSError as err:
        raise SystemExit(f"{where}: not an image ({err})") from None
    return {"jpeg": "jpg"}.get(fmt, fmt or "img")


def convert(files: list[Path], out: Path, max_pairs: int | None = None) -> dict[str, int]:
    """Write OUT/images/* and OUT/pairs.jsonl; returns counts {"pairs", "no_decision"}."""
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    counts = {"pairs": 0, "no_decision": 0}
    with (out / "pairs.jsonl").open("w", encoding="utf-8") as sink:
        for file in files:
            for n, row in enumerate(read_rows(file), 1):
                where = f"{file}:{n}"
                missing = [c for c in COLUMNS if c not in row]
                if missing:
                    raise SystemExit(f"{where}: missing column(s) {missing}; Pick-a-Pic rows have {list(COLUMNS)}")
                label = row["label_0"]
                if label not in (0, 1):  # 0.5: no decision (DiffusionDPO drops these)
                    counts["no_decision"] += 1
                    continue
                if not isinstance(row["caption"], str) or not row["caption"].strip():
                    raise SystemExit(f"{where}: caption must be a non-empty string, got {row['caption']!r}")
                first, second = _image_bytes(row["jpg_0"], where), _image_bytes(row["jpg_1"], where)
                chosen, rejected = (first, second) if label == 1 else (second, first)
                k = counts["pairs"]
                entry = {"prompt": row["caption"]}
                for side, data in (("chosen", chosen), ("rejected", rejected)):
                    name = f"images/{k}_{side}.{_extension(data, where)}"
                    (out / name).write_bytes(data)
                    entry[side] = name
                sink.write(json.dumps(entry) + "\n")
                counts["pairs"] += 1
                if max_pairs is not None and counts["pairs"] >= max_pairs:
                    return counts
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="Pick-a-Pic .parquet shards or .jsonl files")
    parser.add_argument("--out", type=Path, required=True, help="output folder (pairs.jsonl + images/)")
    parser.add_argument("--max-pairs", type=int, default=None, help="stop after this many pairs")
    args = parser.parse_args(argv)
    counts = convert(args.files, args.out, args.max_pairs)
    print(f"{counts['pairs']} pairs -> {args.out / 'pairs.jsonl'} ({counts['no_decision']} no-decision rows dropped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
