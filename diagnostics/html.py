"""``ptops diagnose RUN_DIR --html OUT``: the report as one self-contained page.

Pure: ``render(report, metrics)`` turns the ``diagnose`` report and the run's metrics records
into an HTML string. No JavaScript, no external CSS, fonts or images: the charts are inline SVG
drawn here, so the page opens offline, from a mail attachment or a ticket, years later.

Every string that comes from the run (metric names, log lines, hosts, details) goes through
``_e`` (``html.escape`` with quotes): a run directory is untrusted input, and a metric called
``</svg><script>`` must render as text, not as markup.

Incidents: the ``incidents`` key of the report when it has one (``diagnose`` grouping findings
into incidents), else one row per finding plus the timeline (older reports), so the page is
useful either way.
"""

from __future__ import annotations

import bisect
import datetime as _dt
import html
import math
from collections.abc import Callable, Iterable
from typing import Any

W, H = 760, 230  # one chart
PAD_L, PAD_R, PAD_T, PAD_B = 62, 16, 26, 34
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
SEVERITY_COLOUR = {
    "critical": "#c0392b",
    "error": "#c0392b",
    "warning": "#d68910",
    "info": "#2471a3",
}
# RL curves drawn when present (in this order); keys containing "verifier" are added after them
RL_KEYS = ("reward", "reward_std", "entropy", "kl")


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _num(v: Any) -> float | None:
    """A finite float, or None (missing, text, NaN/Inf: NaN/Inf are drawn separately)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _nonfinite(v: Any) -> bool:
    if isinstance(v, str):
        return v.lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity")
    return isinstance(v, float) and not math.isfinite(v)


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        return "-"
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4 or a < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out, t = [], first
    while t <= hi + step * 1e-9:
        out.append(round(t, 12))
        t += step
    return out


# ---------------------------------------------------------------- incidents


def incidents_of(report: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The incident rows to list and mark, and where they came from (``incidents`` or
    ``findings``)."""
    inc = report.get("incidents")
    if isinstance(inc, list):
        return [i for i in inc if isinstance(i, dict)], "incidents"
    rows = []
    for n, f in enumerate(report.get("findings") or []):
        if not isinstance(f, dict):
            continue
        who = f.get("monitor") or "finding"
        rows.append(
            {
                "id": f"f{n + 1}",
                "kind": who,
                "title": f.get("detail") or who,
                "severity": f.get("severity"),
                "ts": f.get("ts"),
                "ts_end": None,
                "attempt": f.get("attempt"),
                "step": f.get("step"),
                "rank": f.get("rank"),
                "ranks": None,
                "host": f.get("host"),
                "evidence": [f"value {f['value']}"] if f.get("value") is not None else [],
                "runbook": f.get("runbook"),
                "action": None,
                "details": {"source": f.get("source")},
            }
        )
    return rows, "findings"


def _where(i: dict[str, Any]) -> str:
    bits = []
    if i.get("attempt") is not None:
        bits.append(f"attempt {i['attempt']}")
    if i.get("step") is not None:
        bits.append(f"step {i['step']}")
    ranks = i.get("ranks")
    if isinstance(i.get("ranks_text"), str) and ranks:  # ranges (diagnostics/incidents.py)
        bits.append("ranks " + i["ranks_text"])
    elif isinstance(ranks, list) and ranks:
        bits.append("ranks " + ",".join(str(r) for r in ranks))
    elif i.get("rank") is not None:
        bits.append(f"rank {i['rank']}")
    if i.get("host"):
        bits.append(f"host {i['host']}")
    return ", ".join(bits) or "-"


def _ts_to_step(metrics: list[dict[str, Any]]) -> Callable[[Any], float | None]:
    """Map a wall-clock time onto the step axis through the records' own ``ts`` (when they have
    one)."""
    pts = sorted(
        (float(r["ts"]), float(r["step"]))
        for r in metrics
        if _num(r.get("ts")) is not None and _num(r.get("step")) is not None
    )

    times = [p[0] for p in pts]

    def f(ts: Any) -> float | None:
        t = _num(ts)
        if t is None or not pts or t < pts[0][0] - 60:
            return None
        return pts[max(bisect.bisect_right(times, t) - 1, 0)][
            1
        ]  # the step being trained at that time

    return f


def _marker_step(i: dict[str, Any], ts_step: Callable[[Any], float | None]) -> float | None:
    s = _num(i.get("step"))
    return s if s is not None else ts_step(i.get("ts"))


# ---------------------------------------------------------------- charts


Series = dict[str, list[tuple[float, Any]]]


def _series(metrics: list[dict[str, Any]], key: str, by: str) -> Series:
    """``{label: [(step, value)...]}`` in file order; ``by`` = "rank" (one line per rank) or
    "attempt" (the lowest rank's values, one line per attempt: a rollback shows as a new line)."""
    out: Series = {}
    low = min((r["rank"] for r in metrics if isinstance(r.get("rank"), int)), default=None)
    for r in metrics:
        if key not in r or _num(r.get("step")) is None:
            continue
        if by == "attempt":
            if r.get("rank") not in (low, None):
                continue
            label = f"attempt {r.get('attempt', 1)}"
        else:
            label = f"rank {r.get('rank', '?')}"
        out.setdefault(label, []).append((float(r["step"]), r[key]))

    def order(label: str) -> tuple[int, Any]:
        n = label.split(" ", 1)[1]
        try:  # a record's rank is not trusted: "--5" or "²" pass a digit test, not int()
            return (0, int(n))
        except ValueError:
            return (1, n)

    return {k: out[k] for k in sorted(out, key=order)}


MAX_POINTS = (
    1200  # per line segment: a long run's page stays small (the chart is ~700 px wide anyway)
)


def _thin(seg: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """At most ~MAX_POINTS points: per bucket keep the min and the max (spikes stay visible) and the
    ends."""
    if len(seg) <= MAX_POINTS:
        return seg
    size = -(-len(seg) // (MAX_POINTS // 2))
    out = [seg[0]]
    for i in range(0, len(seg), size):
        b = seg[i : i + size]
        lo, hi = min(b, key=lambda p: p[1]), max(b, key=lambda p: p[1])
        out.extend(sorted({lo, hi}))
    out.append(seg[-1])
    return out


def _segments(pts: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """Split where the step goes back (a restart re-doing steps) so no line jumps backwards."""
    segs: list[list[tuple[float, float]]] = []
    for p in pts:
        if not segs or p[0] <= segs[-1][-1][0]:
            segs.append([])
        segs[-1].append(p)
    return [_thin(s) for s in segs]


def chart(
    cid: str, title: str, series: Series, markers: list[dict[str, Any]], y_label: str = ""
) -> str:
    """One inline SVG line chart over steps, with incident markers (vertical lines) and NaN/Inf
    values as crosses along the top edge."""
    finite = [(x, _num(y)) for pts in series.values() for x, y in pts]
    ys = [y for _, y in finite if y is not None]
    xs = [x for x, _ in finite] + [m["x"] for m in markers]
    if not xs:
        return ""
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.1, y1 + (abs(y1) or 1) * 0.1
    span = y1 - y0
    y0, y1 = y0 - span * 0.05, y1 + span * 0.05
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    sx = lambda x: PAD_L + (x - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda y: PAD_T + (1 - (y - y0) / (y1 - y0)) * ph  # noqa: E731
    o = [
        f'<svg class="chart" id="{_e(cid)}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} '
        f'{H}" '
        f'width="{W}" height="{H}" role="img" aria-label="{_e(title)}">',
        f'<text x="{PAD_L}" y="16" class="ctitle">{_e(title)}</text>',
        f'<rect x="{PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}" class="plot"/>',
    ]
    for t in _ticks(y0, y1, 4):
        y = sy(t)
        o.append(
            f'<line x1="{PAD_L}" x2="{PAD_L + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" class="tick" '
            f'text-anchor="end">{_e(_fmt(t))}</text>'
        )
    for t in _ticks(x0, x1, 8):
        x = sx(t)
        o.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T + ph}" y2="{PAD_T + ph + 4}" '
            'class="axis"/>'
            f'<text x="{x:.1f}" y="{PAD_T + ph + 16}" class="tick" '
            f'text-anchor="middle">{_e(_fmt(t))}</text>'
        )
    o.append(
        f'<text x="{PAD_L + pw / 2:.0f}" y="{H - 4}" class="tick" text-anchor="middle">step</text>'
    )
    if y_label:
        o.append(
            f'<text x="12" y="{PAD_T + ph / 2:.0f}" class="tick" text-anchor="middle" '
            f'transform="rotate(-90 12 {PAD_T + ph / 2:.0f})">{_e(y_label)}</text>'
        )
    placed: list[float] = []
    for m in markers:
        x = sx(m["x"])
        slot = _slot(placed, x)
        colour = SEVERITY_COLOUR.get(str(m.get("severity")), "#555")
        o.append(
            '<g class="incident-marker" '
            f'data-incident="{_e(m["id"])}"><title>{_e(m["tip"])}</title>'
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T}" y2="{PAD_T + ph}" stroke="{colour}" '
            f'stroke-width="1.5" stroke-dasharray="4 3"/>'
            f'<text x="{x + 3:.1f}" y="{PAD_T + 11 + 11 * slot}" fill="{colour}" '
            f'class="mlabel">{_e(m["label"])}</text></g>'
        )
    legend_x = PAD_L + pw - sum(8 + 7 * len(label) + 14 for label in series)
    for n, (label, pts) in enumerate(series.items()):
        colour = PALETTE[n % len(PALETTE)]
        good = [(x, _num(y)) for x, y in pts]
        for seg in _segments([(x, y) for x, y in good if y is not None]):
            if len(seg) == 1:
                o.append(
                    f'<circle cx="{sx(seg[0][0]):.1f}" cy="{sy(seg[0][1]):.1f}" r="2.5" '
                    f'fill="{colour}"/>'
                )
            else:
                d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in seg)
                o.append(
                    f'<polyline class="series" points="{d}" fill="none" stroke="{colour}" '
                    'stroke-width="1.6">'
                    f"<title>{_e(label)}</title></polyline>"
                )
        for x, y in pts:
            if _nonfinite(y):
                cx, cy = sx(x), PAD_T + 6
                o.append(
                    f'<g class="nonfinite"><title>{_e(label)}: {_e(y)} at step '
                    f"{_e(_fmt(x))}</title>"
                    f'<path d="M{cx - 4:.1f},{cy - 4:.1f} L{cx + 4:.1f},{cy + 4:.1f} '
                    f"M{cx - 4:.1f},{cy + 4:.1f} "
                    f'L{cx + 4:.1f},{cy - 4:.1f}" stroke="{colour}" stroke-width="2"/></g>'
                )
        o.append(
            f'<rect x="{legend_x:.0f}" y="7" width="10" height="10" fill="{colour}"/>'
            f'<text x="{legend_x + 14:.0f}" y="16" class="legend">{_e(label)}</text>'
        )
        legend_x += 8 + 7 * len(label) + 14
    o.append("</svg>")
    return "".join(o)


def timeline_strip(report: dict[str, Any], incidents: list[dict[str, Any]]) -> str:
    """The run on the wall-clock axis: incidents as markers between the first and last event."""
    s = report.get("events_summary") or {}
    tss = [
        t
        for t in (s.get("first_ts"), s.get("last_ts"), *(i.get("ts") for i in incidents))
        if _num(t) is not None
    ]
    if len(tss) < 2 or max(tss) == min(tss):
        return ""
    t0, t1 = min(tss), max(tss)
    w, h, pl, pr = W, 70, PAD_L, PAD_R
    sx = lambda t: pl + (t - t0) / (t1 - t0) * (w - pl - pr)  # noqa: E731
    o = [
        f'<svg class="chart" id="chart-time" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} '
        f'{h}" '
        f'width="{w}" height="{h}" role="img" aria-label="incidents over time">',
        f'<text x="{pl}" y="14" class="ctitle">incidents over wall-clock time</text>',
        f'<line x1="{pl}" x2="{w - pr}" y1="40" y2="40" class="axis"/>',
    ]
    for t, anchor in ((t0, "start"), (t1, "end")):
        o.append(
            f'<text x="{sx(t):.1f}" y="62" class="tick" text-anchor="{anchor}">'
            f"{_e(_dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).strftime('%H:%M:%S'))}</text>"
        )
    placed: list[float] = []
    for n, i in enumerate(incidents):
        t = _num(i.get("ts"))
        if t is None:
            continue
        colour = SEVERITY_COLOUR.get(str(i.get("severity")), "#555")
        x = sx(t)
        dx = 22 * _slot(placed, x)  # labels of incidents at (nearly) the same time side by side
        te = _num(i.get("ts_end"))
        band = (
            f'<rect x="{x:.1f}" y="33" width="{max(sx(te) - x, 2):.1f}" height="14" '
            f'fill="{colour}" opacity="0.35"/>'
            if te is not None and te > t
            else ""
        )
        o.append(
            f'<g class="incident-marker" data-incident="{_e(i.get("id", n + 1))}">'
            f"<title>{_e(_label(n))} {_e(i.get('kind'))}: {_e(i.get('title'))} "
            f"({_e(_when(t))})</title>{band}"
            f'<circle cx="{x:.1f}" cy="40" r="5" fill="{colour}"/>'
            f'<text x="{x + dx:.1f}" y="28" fill="{colour}" class="mlabel" '
            f'text-anchor="middle">{_e(_label(n))}</text></g>'
        )
    o.append("</svg>")
    return "".join(o)


def _slot(placed: list[float], x: float, near: float = 16) -> int:
    """How many labels already sit within ``near`` px of x (so the next one moves aside); records
    x."""
    k = sum(1 for p in placed if abs(p - x) < near)
    placed.append(x)
    return k


def _label(n: int) -> str:
    return f"#{n + 1}"


# ---------------------------------------------------------------- page


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1c1c1c;max-width:1100px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
.meta{color:#444} .meta b{color:#111} .note{color:#7a5b00}
svg.chart{display:block;margin:6px 0 14px;background:#fff;font-family:system-ui,sans-serif}
.plot{fill:#fbfbfb;stroke:#bbb} .grid{stroke:#e6e6e6} .axis{stroke:#888} .tick{font-size:10px;fill:#555}
.ctitle{font-size:13px;font-weight:600;fill:#222} .legend{font-size:11px;fill:#333} .mlabel{font-size:10px;font-weight:700}
table{border-collapse:collapse;width:100%;font-size:13px} th,td{border:1px solid #ddd;padding:4px 6px;vertical-align:top;text-align:left}
th{background:#f3f3f3} td.sev-critical,td.sev-error{color:#c0392b;font-weight:600} td.sev-warning{color:#b9770e;font-weight:600}
ul.ev{margin:0;padding-left:16px} ul.ev li{white-space:pre-wrap;word-break:break-word;font-family:ui-monospace,monospace;font-size:12px}
.muted{color:#777} details{margin:8px 0}
"""  # noqa: E501


def _incident_table(incidents: list[dict[str, Any]], href: Callable[[str], str | None]) -> str:
    if not incidents:
        return (
            '<p id="no-incidents">No incidents: nothing went wrong that the monitors or the '
            "supervisor saw.</p>"
        )
    rows = []
    for n, i in enumerate(incidents):
        sev = str(i.get("severity") or "")
        ev = i.get("evidence") if isinstance(i.get("evidence"), list) else []
        evidence = "".join(f"<li>{_e(x)}</li>" for x in ev) or '<li class="muted">-</li>'
        details = i.get("details") if isinstance(i.get("details"), dict) else {}
        evidence += "".join(  # about the collection (a dump that failed): not evidence
            f'<li class="note">note: {_e(x)}</li>' for x in details.get("collection_notes") or []
        )
        rb = i.get("runbook")
        if rb:
            url = href(str(rb))
            book = f'<a class="runbook" href="{_e(url)}">{_e(rb)}</a>' if url else _e(rb)
            book += f'<div class="muted">ptops runbook {_e(rb)}</div>'
        else:
            book = '<span class="muted">-</span>'
        action = f'<div class="muted">action: {_e(i["action"])}</div>' if i.get("action") else ""
        rows.append(
            f'<tr class="incident" id="incident-{_e(i.get("id", n + 1))}"><td>{_e(_label(n))}</td>'
            f'<td class="sev-{_e(sev)}">{_e(sev)}</td><td>{_e(i.get("kind"))}</td>'
            f"<td>{_e(i.get('title'))}{action}</td><td>{_e(_where(i))}</td><td>{_e(_when(i.get('ts')))}</td>"
            f'<td><ul class="ev">{evidence}</ul></td><td>{book}</td></tr>'
        )
    return (
        "<table "
        'id="incidents"><thead><tr><th>#</th><th>severity</th><th>kind</th><th>what</th><th>where</th>'
        "<th>when</th><th>evidence</th><th>runbook</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
    )


def _timeline_table(timeline: Iterable[dict[str, Any]]) -> str:
    rows = "".join(
        f"<tr><td>{_e(_when(t.get('ts')))}</td><td>{_e(t.get('step'))}</td><td>{_e(t.get('kind'))}</td>"
        f"<td>{_e(t.get('what'))}</td><td>{_e(t.get('runbook') or '')}</td></tr>"
        for t in timeline
    )
    if not rows:
        return ""
    return (
        '<details id="timeline"><summary>Timeline (every '
        "event)</summary><table><thead><tr><th>when</th>"
        "<th>step</th><th>kind</th><th>what</th><th>runbook</th></tr></thead><tbody>"
        + rows
        + "</tbody></table></details>"
    )


def _default_href(name: str) -> str:
    return f"runbooks/{name}.md"


def render(
    report: dict[str, Any],
    metrics: list[dict[str, Any]],
    runbook_href: Callable[[str], str | None] | None = None,
) -> str:
    """The whole page. ``runbook_href(name)`` gives each runbook's link (None: no link);
    by default the relative ``runbooks/<Name>.md``."""
    href = runbook_href or _default_href
    incidents, source = incidents_of(report)
    ts_step = _ts_to_step(metrics)
    markers = []
    for n, i in enumerate(incidents):
        x = _marker_step(i, ts_step)
        if x is not None:
            markers.append(
                {
                    "x": x,
                    "id": str(i.get("id", n + 1)),
                    "label": _label(n),
                    "severity": i.get("severity"),
                    "tip": f"{_label(n)} {i.get('kind')}: {i.get('title')} ({_where(i)})",
                }
            )
    s = report.get("events_summary") or {}
    charts = []
    specs = [
        ("chart-loss", "loss", "loss", "attempt"),
        ("chart-grad_norm", "grad norm", "grad_norm", "attempt"),
        ("chart-step_s", "step time per rank (s)", "step_s", "rank"),
    ]
    keys = {k for r in metrics for k in r}
    rl = [k for k in RL_KEYS if k in keys] + sorted(k for k in keys if "verifier" in k.lower())
    specs += [(f"chart-rl-{n}", f"RL: {k}", k, "attempt") for n, k in enumerate(rl)]
    for cid, title, key, by in specs:
        ser = _series(metrics, key, by)
        if ser:
            charts.append(chart(cid, title, ser, markers, key))
    notes = "".join(f'<p class="note">note: {_e(x)}</p>' for x in report.get("notes") or [])
    counts = (
        ", ".join(f"{_e(k)} {_e(v)}" for k, v in sorted((s.get("counts") or {}).items())) or "none"
    )
    fallback = (
        ""
        if source == "incidents"
        else '<p class="muted">This report has no incident grouping; each finding is listed as '
        "its own row.</p>"
    )
    page = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>ptops diagnose: "
        f"{_e(report.get('run_dir'))}</title><style>{CSS}</style></head><body>",
        f"<h1>ptops diagnose: {_e(report.get('run_dir'))}</h1>",
        f'<p class="meta">recipe <b>{_e(report.get("recipe") or "?")}</b> · state '
        f"<b>{_e(s.get('state'))}</b>"
        f" · attempts <b>{_e(s.get('attempts'))}</b> · last step "
        f"<b>{_e(report.get('last_step'))}</b>"
        f" · ranks <b>{_e(','.join(str(r) for r in report.get('ranks') or []) or '-')}</b>"
        f" · last good checkpoint step <b>{_e(s.get('last_checkpoint_step'))}</b></p>",
        f'<p class="meta">{_e(s.get("reason") or "")}</p>' if s.get("reason") else "",
        f'<p class="meta">events: {counts} · from {_e(_when(s.get("first_ts")))} to '
        f"{_e(_when(s.get('last_ts')))}"
        f" · monitors config: {_e(report.get('config'))}</p>",
        notes,
        f"<h2>Incidents ({len(incidents)})</h2>",
        fallback,
        _incident_table(incidents, href),
        "<h2>Curves</h2>",
        timeline_strip(report, incidents),
        "".join(charts) or '<p class="muted">No metrics recorded.</p>',
        '<p class="muted">Dashed lines: incidents (hover for what). Crosses on the top edge: '
        "NaN/Inf values. "
        "Loss, grad norm and RL curves: the lowest rank, one line per attempt (a rollback or "
        "restart starts a new "
        "line); step time: one line per rank.</p>",
        _timeline_table(report.get("timeline") or []),
        '<p class="muted">Generated by ptops diagnose --html. Self-contained: no scripts, no '
        "network.</p>",
        "</body></html>",
    ]
    return "\n".join(p for p in page if p)
