"""``eagle3d report --html FILE``: one self-contained page of plots (plotly, its JavaScript
inlined so the page opens offline) and the report's tables.

Plots, sharing one time axis, one trace per shard: samples saved (and failed) over time;
tokens/s (the live rate of :mod:`eagle3proto.views` over 10 s of working time); the output
disk's used bytes and where the rest of the job takes it (projected at the mean sample size);
in-flight and committing depths; the GPUs' mean utilisation when the journal recorded it.
Pauses are shaded on every plot. Imported only by ``report --html``: plotly is an optional
extra (``eagle3d[report]``).
"""

from __future__ import annotations

import datetime as dt
import html
import os
from typing import Any

from eagle3d.tools.story import Point, ShardStory

#: At most this many points per trace (evenly thinned; the first and last always kept).
MAX_POINTS = 4000


def _thin(points: list[Point]) -> list[Point]:
    if len(points) <= MAX_POINTS:
        return points
    step = len(points) / MAX_POINTS
    picked = [points[int(i * step)] for i in range(MAX_POINTS - 1)]
    return [*picked, points[-1]]


def _when(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts)


def figure(stories: list[ShardStory]) -> Any:
    """The plotly figure: four or five rows of plots on one time axis, pauses shaded."""
    from plotly.subplots import make_subplots

    has_gpu = any(p.gpu_util is not None for st in stories for p in st.points)
    titles = [
        "samples saved and failed",
        "tokens/s (over 10 s of working time)",
        "output disk used, and projected at the job's end",
        "in flight and committing",
    ]
    if has_gpu:
        titles.append("GPU utilisation (mean over devices, %)")
    fig = make_subplots(
        rows=len(titles), cols=1, shared_xaxes=True, subplot_titles=titles, vertical_spacing=0.06
    )
    for st in stories:
        _shard_traces(fig, st, has_gpu)
        _shade_pauses(fig, st)
    fig.update_yaxes(title_text="bytes", row=3, col=1)
    fig.update_layout(height=260 * len(titles), template="plotly_white", hovermode="x unified")
    return fig


def _line(
    fig: Any, row: int, pts: list[Point], y: list[Any], name: str, dash: str = "solid"
) -> None:
    import plotly.graph_objects as go

    x = [_when(p.t) for p in pts]
    trace = go.Scatter(x=x, y=y, name=name, mode="lines", line={"dash": dash})
    fig.add_trace(trace, row=row, col=1)


def _shard_traces(fig: Any, st: ShardStory, has_gpu: bool) -> None:
    """One shard's traces on every plot."""
    pts, name = _thin(st.points), st.name
    _line(fig, 1, pts, [p.saved for p in pts], f"saved {name}")
    _line(fig, 1, pts, [p.failed for p in pts], f"failed {name}", "dot")
    _line(fig, 2, pts, [round(p.tokens_s, 1) for p in pts], f"tokens/s {name}")
    disk = [p for p in pts if p.disk_used is not None]
    if disk:
        _line(fig, 3, disk, [p.disk_used for p in disk], f"disk used {name}")
        proj = [_projected(st, p) for p in disk]
        _line(fig, 3, disk, proj, f"projected at the end {name}", "dash")
    _line(fig, 4, pts, [p.in_flight for p in pts], f"in flight {name}")
    _line(fig, 4, pts, [p.committing for p in pts], f"committing {name}", "dot")
    if has_gpu:
        gp = [p for p in pts if p.gpu_util is not None]
        _line(fig, 5, gp, [p.gpu_util for p in gp], f"GPU {name}")


def _shade_pauses(fig: Any, st: ShardStory) -> None:
    for pause in st.pauses:
        end = pause.end if pause.end is not None else st.last_ts
        fig.add_vrect(
            x0=_when(pause.start),
            x1=_when(end),
            fillcolor="orange",
            opacity=0.25,
            line_width=0,
            annotation_text="paused",
            annotation_position="top left",
            row="all",
            col=1,
        )


def _projected(st: ShardStory, p: Point) -> int | None:
    """The output disk's used bytes when the rest of the job is written at the mean size
    so far (None until a sample is saved)."""
    s = st.state
    if p.disk_used is None or p.saved == 0 or s.total < 0:
        return None
    left = max(s.total - p.saved - p.failed, 0)
    return int(p.disk_used + s.bytes_saved / max(s.saved, 1) * left)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    h = "".join(f"<th>{html.escape(str(c))}</th>" for c in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def page(doc: dict[str, Any], stories: list[ShardStory]) -> str:
    """The whole page: the summary table, the plots, then every failure."""
    fig = figure(stories)
    plot = fig.to_html(full_html=False, include_plotlyjs=True, div_id="eagle3d-plots")
    cols = ["shard", "saved", "total", "failed", "truncated", "left", "tokens", "bytes"]
    cols += ["wall_s", "working_s", "paused_s", "rate_samples_s", "rate_tokens_s", "restarts"]
    rows = [[d.get(c, "") for c in cols] for d in doc["shards"]]
    if len(stories) > 1:
        rows.append([("total" if c == "shard" else doc["total"].get(c, "")) for c in cols])
    fails = [
        [f["shard"], f["idx"], f["reason"], f["attempts"], f["message"]] for f in doc["failures"]
    ]
    by = doc["total"]["failures_by_reason"]
    pauses = [
        [d["shard"], p["start_ts"], p["end_ts"], p["seconds"], p["cause"]]
        for d in doc["shards"]
        for p in d["pauses"]
    ]
    title = f"eagle3d report: {html.escape(doc['output'])}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
td, th {{ border: 1px solid #ccc; padding: 2px 6px; text-align: left; }}
</style></head>
<body>
<h1>{title}</h1>
<h2>Summary</h2>
{_table(cols, rows)}
<h2>Over time</h2>
{plot}
<h2>Pauses</h2>
{_table(["shard", "start", "end", "seconds", "cause"], pauses) if pauses else "<p>none</p>"}
<h2>Failures ({len(fails):,})</h2>
{_table(["reason", "samples"], [[k, v] for k, v in by.items()]) if by else "<p>none</p>"}
{_table(["shard", "row", "reason", "attempts", "message"], fails) if fails else ""}
</body></html>
"""


def write(path: str, doc: dict[str, Any], stories: list[ShardStory]) -> None:
    """Write the page to ``path`` (a temporary file beside it, then renamed)."""
    text = page(doc, stories)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


__all__ = ["figure", "page", "write"]
