#!/usr/bin/env python
"""Fetch the prompt files the real recipes read (configs/t2i/real/): one UTF-8 prompt per line under prompts/.

    python scripts/fetch_prompts.py pickscore        # prompts/pickscore_train.txt, prompts/pickscore_test.txt
    python scripts/fetch_prompts.py pickscore_sfw    # prompts/pickscore_sfw_{train,test}.txt (TP-GRPO)
    python scripts/fetch_prompts.py hpdv2            # prompts/hpdv2_train.txt, prompts/hpdv2_test.txt
    python scripts/fetch_prompts.py unigenbench      # prompts/unigenbench_train.txt (Pref-GRPO)
    python scripts/fetch_prompts.py ocr              # prompts/ocr_train.txt, prompts/ocr_test.txt (GARDO)
    python scripts/fetch_prompts.py dancegrpo_video  # prompts/dancegrpo_video_train.txt (DanceGRPO HunyuanVideo)
    python scripts/fetch_prompts.py refl             # prompts/refl_train.txt (ReFL)
    python scripts/fetch_prompts.py simple_animals   # prompts/simple_animals_{train,test}.txt (AlignProp)
    python scripts/fetch_prompts.py --check          # what is there: files, prompt counts, problems
    python scripts/fetch_prompts.py hpdv2_test --from benchmark/photo.json benchmark/anime.json   # offline

Sources (the published sets, not shipped here for their size and licences):
    pickscore  the Flow-GRPO repository's dataset/pickscore/{train,test}.txt (Pick-a-Pic prompts)
    pickscore_sfw  the Flow-GRPO repository's dataset/pickscore_sfw/{train,test}.txt (Pick-a-Pic's SFW
               captions), which TP-GRPO's config/my_grpo.py reads as `dataset/pickscore_sfw`
    hpdv2      the HPDv2 dataset on the Hugging Face hub (zhwang/HPDv2): train.json's prompts for
               train, benchmark/{anime,concept-art,paintings,photo}.json (3,200 prompts) for test
    ocr        the Flow-GRPO repository's dataset/ocr/{train,test}.txt (the OCR task; GARDO's release reads the
               same files)
    dancegrpo_video  the DanceGRPO repository's assets/video_prompts.txt (VidProM-filtered video prompts;
               github.com/XueZeyue/DanceGRPO); train only
    unigenbench  the Pref-GRPO repository's data/unigenbench_train_data.txt (UniGenBench's train prompts;
               github.com/CodeGoat24/Pref-GRPO); there is no test split here (UniGenBench's test prompts
               are a benchmark, github.com/CodeGoat24/UniGenBench)
    refl       ImageReward's data/refl_data.json (THUDM/ImageReward @ 1beb4e4), the "text" of its 10,000 rows
               (9,798 distinct once stripped), which ReFL's refl.py trains on; train only (ReFL runs no evaluation)
    simple_animals  AlignProp's assets/simple_animals.txt (45 animals; prompts.py `simple_animals` picks one at
               random per sample) for train and assets/eval_simple_animals.txt (6) for test
               (mihirp1998/AlignProp @ 185d154)
A failed download says so and names `--from`, which converts local copies instead (.txt one per line,
.json a list of strings or of objects with "prompt", .jsonl objects with "prompt"). Prompts are stripped;
empty lines and repeats are dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
FLOW_GRPO = "https://raw.githubusercontent.com/yifan123/flow_grpo/main/dataset/{name}/{split}.txt"
PREF_GRPO = "https://raw.githubusercontent.com/CodeGoat24/Pref-GRPO/main/data/unigenbench_train_data.txt"
DANCE_GRPO_VIDEO = "https://raw.githubusercontent.com/XueZeyue/DanceGRPO/main/assets/video_prompts.txt"
HPD_REPO, HPD_STYLES = "zhwang/HPDv2", ("anime", "concept-art", "paintings", "photo")
# ReFL's and AlignProp's prompt files at the commits their recipes were read from (docs/recipes.md)
REFL_DATA = (
    "https://raw.githubusercontent.com/THUDM/ImageReward/1beb4e4de0932acbe7fc090c51208048b6269b58/data/refl_data.json"
)
ALIGNPROP = (
    "https://raw.githubusercontent.com/mihirp1998/AlignProp/185d154bc1ec25260846a2cb040841377c706d6a/assets/{name}"
)


def prompts_in(text: str, name: str) -> list[str]:
    """Prompts of a .txt / .json / .jsonl document."""
    if name.endswith(".jsonl"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    elif name.endswith(".json"):
        rows = json.loads(text)
        rows = rows if isinstance(rows, list) else rows.get("prompts", [])
    else:
        return [line for line in text.splitlines()]
    # "text": ReFL's data/refl_data.json rows are {"text": caption, "image": id}
    return [row if isinstance(row, str) else row.get("prompt") or row.get("text", "") for row in rows]


def write_prompts(prompts: Iterable[str], path: Path) -> int:
    """Strip, drop empty and repeated prompts, write UTF-8 atomically; the number written."""
    kept = list(dict.fromkeys(p.strip().replace("\n", " ") for p in prompts if p and p.strip()))
    if not kept:
        raise SystemExit(f"fetch_prompts: no prompts for {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(p + "\n" for p in kept))
    os.replace(tmp, path)
    return len(kept)


def _url(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=120) as response:  # noqa: S310 - fixed https URLs
        return response.read().decode("utf-8"), url


def _hub(filename: str) -> tuple[str, str]:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(HPD_REPO, filename, repo_type="dataset")
    return Path(path).read_text(encoding="utf-8"), filename


SOURCES: dict[str, list[Callable[[], tuple[str, str]]]] = {
    "pickscore_train": [lambda: _url(FLOW_GRPO.format(name="pickscore", split="train"))],
    "pickscore_test": [lambda: _url(FLOW_GRPO.format(name="pickscore", split="test"))],
    "pickscore_sfw_train": [lambda: _url(FLOW_GRPO.format(name="pickscore_sfw", split="train"))],
    "pickscore_sfw_test": [lambda: _url(FLOW_GRPO.format(name="pickscore_sfw", split="test"))],
    "hpdv2_train": [lambda: _hub("train.json")],
    "hpdv2_test": [lambda s=s: _hub(f"benchmark/{s}.json") for s in HPD_STYLES],
    "unigenbench_train": [lambda: _url(PREF_GRPO)],
    "ocr_train": [lambda: _url(FLOW_GRPO.format(name="ocr", split="train"))],
    "ocr_test": [lambda: _url(FLOW_GRPO.format(name="ocr", split="test"))],
    "dancegrpo_video_train": [lambda: _url(DANCE_GRPO_VIDEO)],
    "refl_train": [lambda: _url(REFL_DATA)],
    "simple_animals_train": [lambda: _url(ALIGNPROP.format(name="simple_animals.txt"))],
    "simple_animals_test": [lambda: _url(ALIGNPROP.format(name="eval_simple_animals.txt"))],
}
GROUPS = {
    "pickscore": ["pickscore_train", "pickscore_test"],
    "pickscore_sfw": ["pickscore_sfw_train", "pickscore_sfw_test"],
    "hpdv2": ["hpdv2_train", "hpdv2_test"],
    "unigenbench": ["unigenbench_train"],
    "ocr": ["ocr_train", "ocr_test"],
    "dancegrpo_video": ["dancegrpo_video_train"],
    "refl": ["refl_train"],
    "simple_animals": ["simple_animals_train", "simple_animals_test"],
}
GROUP_OF = {name: group for group, names in GROUPS.items() for name in names}


def check(folder: Path) -> int:
    """Print each expected file's prompt count or problem; 0 when all are usable."""
    bad = 0
    for name in SOURCES:
        path = folder / f"{name}.txt"
        try:
            n = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
            print(f"{path}: {n} prompts" if n else f"{path}: EMPTY")
            bad += n == 0
        except FileNotFoundError:
            print(f"{path}: missing (python scripts/fetch_prompts.py {GROUP_OF[name]})")
            bad += 1
        except UnicodeDecodeError as err:
            print(f"{path}: not UTF-8 (byte {err.start})")
            bad += 1
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sets", nargs="*", help=f"any of {sorted(GROUPS)} or {sorted(SOURCES)}")
    parser.add_argument("--from", dest="local", nargs="+", metavar="FILE", help="convert local files (one set)")
    parser.add_argument("--out", default=str(ROOT / "prompts"), help="folder (default: prompts/ of the checkout)")
    parser.add_argument("--check", action="store_true", help="report the files present and exit")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.check:
        return check(out)
    names = [n for s in args.sets for n in GROUPS.get(s, [s])]
    unknown = [n for n in names if n not in SOURCES]
    if unknown or not names:
        parser.error(f"choose from {sorted(GROUPS)} or {sorted(SOURCES)}; got {args.sets}")
    if args.local and len(names) != 1:
        parser.error("--from fills one set, e.g. hpdv2_test")
    for name in names:
        if args.local:
            docs = [(Path(f).read_text(encoding="utf-8"), f) for f in args.local]
        else:
            try:
                docs = [fetch() for fetch in SOURCES[name]]
            except Exception as err:  # noqa: BLE001 - network, HTTP and hub errors alike: one line, and the way out
                raise SystemExit(
                    f"fetch_prompts: {name}: download failed ({type(err).__name__}: {err}); get the file by hand "
                    f"(sources: python scripts/fetch_prompts.py --help) and run: "
                    f"python scripts/fetch_prompts.py {name} --from FILE"
                ) from None
        prompts = [p for text, where in docs for p in prompts_in(text, where)]
        print(f"{out / (name + '.txt')}: {write_prompts(prompts, out / f'{name}.txt')} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
