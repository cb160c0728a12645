"""A self-contained HTML report: every image and plot is embedded as a base64 data URI, the CSS and
the one script are inline, and nothing refers to another address, so the file can be mailed or
archived as it is.

Contents: the summary table (mean, bootstrap CI, std, count, NaN count, min / median / max per score
key); with a comparison, the per-key table of run A vs run B (means, mean difference with its CI, win
rate) and the pairwise scorers' preferences; then per main score key a histogram (A and B overlaid in a
comparison), the best and worst k images with prompt and score, and in a comparison the k matched
pairs where B gained most and lost most. A small inline script marks <body> with
data-images-loaded / data-images-total / data-images-ok once every <img> has decoded (tests read it).
An edit (a sample whose metadata "images" names its input images) is shown as one row: its source image(s),
then the edit (in a comparison: source(s), A, B); the script also counts the rows whose first source is laid
out left of the edit on one line (data-edit-rows / data-edit-rows-beside).

Videos (a run of clips, flowgrpo/video_io.py) are not embedded: the report links the files where they lie (a
generated run's `images/` beside the report) by relative paths, an MP4 in `<video controls loop muted>`, an animated
WebP in an `<img>`; move the folder as a whole. The script also marks <body> with data-videos-total /
data-videos-loaded / data-videos-ok (a video counts once it has a frame to show: readyState >= 2, videoWidth > 0).
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from ..video_io import is_video

from .config import ReportConfig
from .hacking import hacking_section
from .results import Run
from .stats import finite

_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px; color: #1d1d1f; background: #fff; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
h3 { margin: 1em 0 0.4em; font-size: 1.05em; color: #333; }
.meta { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f2f2f5; }
.grid { display: flex; flex-wrap: wrap; gap: 10px; }
figure { margin: 0; width: var(--thumb); }
figure video { width: var(--thumb); height: auto; display: block; border: 1px solid #ddd; }
figure img { width: var(--thumb); height: auto; display: block; image-rendering: pixelated; border: 1px solid #ddd; }
figcaption { font-size: 0.78em; line-height: 1.25; margin-top: 3px; word-wrap: break-word; }
figcaption .score { font-weight: 600; } figcaption .file { color: #888; }
.pair { display: flex; gap: 4px; } .pair figure { width: var(--thumb); }
.pairbox { border: 1px solid #e3e3e8; padding: 6px; border-radius: 4px; }
.pairbox .cap { font-size: 0.78em; max-width: calc(2 * var(--thumb) + 4px); word-wrap: break-word; }
.missing { width: var(--thumb); height: var(--thumb); background: #f6f6f6; color: #999; font-size: 0.8em;
           display: flex; align-items: center; justify-content: center; }
.up { color: #0a7d32; } .down { color: #b3261e; }
figure.source figcaption { color: #666; }
"""

# Marks <body> once every image has decoded; headless-browser tests read these attributes.
_SCRIPT = """
window.addEventListener('load', function () {
  var images = Array.prototype.slice.call(document.images);
  var ok = images.filter(function (im) { return im.complete && im.naturalWidth > 0; }).length;
  document.body.setAttribute('data-images-total', String(images.length));
  document.body.setAttribute('data-images-loaded', String(ok));
  document.body.setAttribute('data-images-ok', ok === images.length ? 'true' : 'false');
  var edits = document.querySelectorAll('.edit'), beside = 0;
  Array.prototype.forEach.call(edits, function (row) {
    var s = row.querySelector('figure.source img'), e = row.querySelector('figure.edited img');
    if (!s || !e) { return; }
    var a = s.getBoundingClientRect(), b = e.getBoundingClientRect();
    if (a.width > 0 && b.width > 0 && a.right <= b.left && Math.abs(a.top - b.top) < 1) { beside += 1; }
  });
  document.body.setAttribute('data-edit-rows', String(edits.length));
  document.body.setAttribute('data-edit-rows-beside', String(beside));
  markVideos();
});
function markVideos() {
  var videos = Array.prototype.slice.call(document.querySelectorAll('video'));
  var ok = videos.filter(function (v) { return v.readyState >= 2 && v.videoWidth > 0; }).length;
  document.body.setAttribute('data-videos-total', String(videos.length));
  document.body.setAttribute('data-videos-loaded', String(ok));
  document.body.setAttribute('data-videos-ok', ok === videos.length ? 'true' : 'false');
}
Array.prototype.forEach.call(document.querySelectorAll('video'), function (v) {
  v.addEventListener('loadeddata', markVideos);
  v.addEventListener('error', markVideos);
});
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    return f"{float(value):.4g}"


class Thumbnails:
    """Embedded thumbnails, each image encoded once."""

    def __init__(self, size: int, fmt: str = "jpeg", base: Optional[Path] = None):
        self.size, self.fmt = size, fmt
        self.base = base  # the report's folder: videos are linked relative to it
        self._cache: dict[Path, Optional[str]] = {}

    def uri(self, path: Path) -> Optional[str]:
        if path not in self._cache:
            try:
                with Image.open(path) as im:
                    im = im.convert("RGB")
                im.thumbnail((self.size, self.size))
                buf = io.BytesIO()
                if self.fmt == "png":
                    im.save(buf, format="PNG", optimize=True)
                else:
                    im.save(buf, format="JPEG", quality=85)
                self._cache[path] = f"data:image/{self.fmt};base64," + base64.b64encode(buf.getvalue()).decode("ascii")
            except OSError:
                self._cache[path] = None  # shown as a "missing" box, not a broken <img>
        return self._cache[path]

    def link(self, path: Path) -> str:
        """A URL of `path` relative to the report's folder (absolute without one)."""
        from urllib.parse import quote

        if self.base is None:
            return path.resolve().as_uri()
        return quote(Path(os.path.relpath(path.resolve(), self.base.resolve())).as_posix())

    def figure(self, path: Path, caption: str, title: str = "", cls: str = "") -> str:
        if path.is_file() and is_video(path):  # linked, not embedded
            link = self.link(path)
            img = (
                f'<video src="{link}" controls loop muted preload="auto" title="{_e(path.name)}"></video>'
                if path.suffix.lower() == ".mp4"
                else f'<img src="{link}" alt="{_e(path.name)}" loading="eager">'  # an animated WebP / GIF
            )
        else:
            uri = self.uri(path)
            img = (
                f'<img src="{uri}" alt="{_e(path.name)}" loading="eager">'
                if uri
                else f'<div class="missing">missing: {_e(path.name)}</div>'
            )
        klass = f' class="{cls}"' if cls else ""
        return f'<figure{klass} title="{_e(title)}">{img}<figcaption>{caption}</figcaption></figure>'


def histogram_uri(series: Sequence[tuple[str, np.ndarray]], bins: int, xlabel: str) -> Optional[str]:
    """A histogram (several series overlaid on shared bins) as a PNG data URI; None without data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = [(label, finite(v)) for label, v in series]
    values = np.concatenate([v for _, v in data]) if data else np.empty(0)
    if values.size == 0:
        return None
    edges = np.histogram_bin_edges(values, bins=bins)
    fig = Figure(figsize=(5.2, 2.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = ["#8a8a8f", "#2f6fdb"] if len(data) > 1 else ["#2f6fdb"]
    for (label, v), color in zip(data, colors):
        ax.hist(v, bins=edges, alpha=0.55 if len(data) > 1 else 0.9, color=color, label=f"{label} (n={v.size})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("images")
    if len(data) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _caption(score: float, prompt: str, name: str) -> str:
    short = prompt if len(prompt) <= 110 else prompt[:107] + "..."
    return f'<span class="score">{fmt(score)}</span> · {_e(short)} <span class="file">{_e(name)}</span>'


def _sources(thumbs: Thumbnails, run: Run, i: int) -> list[str]:
    """Figures of sample i's input images (metadata "images"), empty for a text-to-image sample."""
    s = run.samples[i]
    names = s.metadata.get("images")
    if not isinstance(names, list):
        return []
    paths = [Path(n) if Path(n).is_absolute() else run.root / n for n in names if isinstance(n, str)]
    label = "source" if len(paths) == 1 else "source {}"
    return [thumbs.figure(p, label.format(k + 1), s.prompt, "source") for k, p in enumerate(paths)]


def _edit_row(thumbs: Thumbnails, run: Run, i: int, caption: str) -> str:
    """Sample i's figure; an edit as one row: source(s), then the edit with the caption."""
    s = run.samples[i]
    sources = _sources(thumbs, run, i)
    edit = thumbs.figure(run.path(i), caption, s.prompt, "edited" if sources else "")
    return f'<div class="pairbox edit"><div class="pair">{"".join(sources)}{edit}</div></div>' if sources else edit


def _ranked(values: np.ndarray, k: int) -> tuple[list[int], list[int]]:
    """Indices of the k highest and the k lowest finite values (stable order)."""
    ok = np.flatnonzero(np.isfinite(values))
    order = ok[np.argsort(-values[ok], kind="stable")]
    return list(order[:k]), list(order[::-1][:k])


def _summary_table(scores: dict[str, dict], confidence: float) -> str:
    head = (
        f"<tr><th>score</th><th>mean</th><th>{confidence:.0%} CI</th><th>std</th><th>count</th>"
        "<th>NaN</th><th>min</th><th>median</th><th>max</th></tr>"
    )
    rows = [
        f"<tr><td>{_e(k)}</td><td>{fmt(s['mean'])}</td><td>[{fmt(s['ci_low'])}, {fmt(s['ci_high'])}]</td>"
        f"<td>{fmt(s['std'])}</td><td>{s['count']}</td><td>{s['nan_count']}</td><td>{fmt(s['min'])}</td>"
        f"<td>{fmt(s['median'])}</td><td>{fmt(s['max'])}</td></tr>"
        for k, s in scores.items()
    ]
    return f"<table>{head}{''.join(rows)}</table>"


def _comparison_tables(comp: dict, confidence: float) -> str:
    parts = [
        f'<p class="meta">A = <b>{_e(comp["a"])}</b> ({_e(comp["a_dir"])}), B = <b>{_e(comp["b"])}</b>. '
        f"Matched by (prompt, index): {comp['matched']} pairs; {comp['unmatched_a']} images only in A, "
        f"{comp['unmatched_b']} only in B. Win rate = share of pairs where B scores higher (ties 0.5).</p>"
    ]
    if comp["scores"]:
        head = (
            f"<tr><th>score</th><th>mean A</th><th>mean B</th><th>mean B−A</th><th>{confidence:.0%} CI of B−A</th>"
            "<th>win rate B</th><th>pairs</th><th>NaN pairs</th></tr>"
        )
        rows = []
        for k, c in comp["scores"].items():
            d = c["mean_diff"]
            cls = "up" if isinstance(d, float) and d > 0 else "down" if isinstance(d, float) and d < 0 else ""
            rows.append(
                f"<tr><td>{_e(k)}</td><td>{fmt(c['mean_a'])}</td><td>{fmt(c['mean_b'])}</td>"
                f'<td class="{cls}">{fmt(d)}</td><td>[{fmt(c["diff_ci_low"])}, {fmt(c["diff_ci_high"])}]</td>'
                f"<td>{fmt(c['win_rate'])}</td><td>{c['pairs']}</td><td>{c['nan_pairs']}</td></tr>"
            )
        parts.append(f"<table>{head}{''.join(rows)}</table>")
    if comp.get("pairwise"):
        head = "<tr><th>pairwise scorer</th><th>mean P(B beats A)</th><th>pairs</th><th>NaN pairs</th></tr>"
        rows = [
            f"<tr><td>{_e(k)}</td><td>{fmt(c['mean_p_b_beats_a'])}</td><td>{c['pairs']}</td>"
            f"<td>{c['nan_pairs']}</td></tr>"
            for k, c in comp["pairwise"].items()
        ]
        parts.append(f"<table>{head}{''.join(rows)}</table>")
    if comp.get("only_in_a") or comp.get("only_in_b"):
        parts.append(
            f'<p class="meta">Scores in one run only (not compared): A {_e(comp.get("only_in_a"))}, '
            f"B {_e(comp.get('only_in_b'))}</p>"
        )
    return "".join(parts)


def _pair_grid(
    thumbs: Thumbnails,
    run_a: Run,
    run_b: Run,
    ia: np.ndarray,
    ib: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    order: Sequence[int],
) -> str:
    boxes = []
    for m in order:
        i, j = int(ia[m]), int(ib[m])
        s = run_b.samples[j]
        sources = _sources(thumbs, run_b, j)
        fa = thumbs.figure(run_a.path(i), f'A <span class="score">{fmt(a[m])}</span>', s.prompt)
        fb = thumbs.figure(
            run_b.path(j), f'B <span class="score">{fmt(b[m])}</span>', s.prompt, "edited" if sources else ""
        )
        short = s.prompt if len(s.prompt) <= 110 else s.prompt[:107] + "..."
        boxes.append(
            f'<div class="pairbox{" edit" if sources else ""}"><div class="pair">{"".join(sources)}{fa}{fb}</div>'
            '<div class="cap">B−A '
            f"<b>{fmt(b[m] - a[m])}</b> · #{s.index} · {_e(short)}</div></div>"
        )
    return f'<div class="grid">{"".join(boxes)}</div>' if boxes else '<p class="meta">no pairs with finite scores</p>'


def build_report(
    run_b: Run,
    summary: dict,
    cfg: ReportConfig,
    run_a: Optional[Run] = None,
    pairs: Optional[tuple[np.ndarray, np.ndarray]] = None,
    progress: bool = False,
) -> str:
    """The report of run B (and its comparison with run A when given) as one HTML string."""
    thumbs = Thumbnails(cfg.thumbnail_size, cfg.thumbnail_format, run_b.root)  # the report lies in run B's folder
    confidence = summary["stats"]["confidence"]
    title = cfg.title or f"Evaluation: {run_b.label}"
    comp = summary.get("comparison")
    created = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = [
        f"<h1>{_e(title)}</h1>",
        f'<p class="meta">{len(run_b.samples)} images · run <b>{_e(run_b.label)}</b> · {_e(summary["source"])} · '
        f"{created}<br>Intervals: {_e(summary['stats']['ci_method'])}. std: sample standard deviation (ddof 1). "
        "NaN = could not score, left out of the statistics.</p>",
        "<h2>Summary</h2>",
        _summary_table(summary["scores"], confidence),
        hacking_section(summary["hacking"], fmt, _e) if summary.get("hacking") else "",
    ]
    if comp is not None:
        body += ["<h2>Comparison</h2>", _comparison_tables(comp, confidence)]
    keys = run_b.main_keys
    for key in tqdm(keys, desc="report", disable=not progress):
        values = run_b.scores[key]
        body.append(f'<h2 id="{_e(key)}">{_e(key)}</h2>')
        series = [(run_b.label, values)]
        compared = run_a is not None and pairs is not None and key in run_a.scores
        if compared:
            series.insert(0, (run_a.label, run_a.scores[key]))
        uri = histogram_uri(series, cfg.histogram_bins, key)
        body.append(
            f'<img class="hist" src="{uri}" alt="histogram of {_e(key)}">'
            if uri
            else '<p class="meta">no finite scores</p>'
        )
        if cfg.top_k:
            best, worst = _ranked(values, cfg.top_k)
            for name, idx in (("Best", best), ("Worst", worst)):
                figs = [
                    _edit_row(
                        thumbs, run_b, i, _caption(values[i], run_b.samples[i].prompt, Path(run_b.samples[i].file).name)
                    )
                    for i in idx
                ]
                body.append(f'<h3>{name} {len(idx)}</h3><div class="grid">{"".join(figs)}</div>')
        if compared and cfg.top_k:
            ia, ib = pairs
            a, b = run_a.scores[key][ia], values[ib]
            gain, loss = _ranked(b - a, cfg.top_k)
            body.append(f"<h3>Largest gains of B over A ({_e(run_b.label)} vs {_e(run_a.label)})</h3>")
            body.append(_pair_grid(thumbs, run_a, run_b, ia, ib, a, b, gain))
            body.append("<h3>Largest losses of B against A</h3>")
            body.append(_pair_grid(thumbs, run_a, run_b, ia, ib, a, b, loss))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>:root {{ --thumb: {cfg.thumbnail_size}px; }}{_CSS}</style></head>"
        f"<body>{''.join(body)}<script>{_SCRIPT}</script></body></html>\n"
    )
