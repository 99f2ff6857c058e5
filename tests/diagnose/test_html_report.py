"""``ptops diagnose RUN_DIR --html OUT``: the page renders offline in a real headless Chromium.

Real faulted runs (crash, nan) go through the real CLI; the page is opened from file:// in
Debian's Chromium driven by Playwright, with the network closed: no console errors, no page
errors, a screenshot of real size, the SVG charts and the incident markers in the DOM. Hostile
strings from a run (a metric name, a log line, a host) stay text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, run_ptops

from ptops.diagnostics.html import incidents_of, render

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
EVIL = '</svg></table><script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


@pytest.fixture(scope="module")
def browser(request):
    path = request.getfixturevalue("have")("chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def _open(browser, page_path: Path, shot: Path) -> tuple[object, list[str]]:
    """Load the page with every network request refused; return the page and the errors seen."""
    ctx = browser.new_context(viewport={"width": 1200, "height": 900}, offline=True)
    page = ctx.new_page()
    errors: list[str] = []
    page.on(
        "console",
        lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
    )
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    fetched: list[str] = []

    def _route(route):
        fetched.append(route.request.url)
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            route.abort()

    page.route("**/*", _route)
    page.goto(page_path.resolve().as_uri(), wait_until="load")
    page.screenshot(path=str(shot), full_page=True)
    assert [u for u in fetched if not u.startswith("file:")] == [], (
        f"the page asked the network for {fetched}"
    )
    return page, errors


def _diagnose_html(run: Path, out: Path) -> dict:
    proc = run_ptops("diagnose", str(run), "--json", "--html", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.is_file() and f"wrote {out}" in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("kind", ["crash", "nan"])
def test_html_report_of_a_faulted_run_renders_in_chromium(faulted_runs, browser, tmp_path, kind):
    run = faulted_runs.get(kind).run
    out = tmp_path / f"{kind}.html"
    report = _diagnose_html(run, out)
    text = out.read_text()
    assert "<script" not in text.lower() and "http://" not in text.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )
    shot = tmp_path / f"{kind}.png"
    page, errors = _open(browser, out, shot)
    assert errors == [], errors
    assert shot.stat().st_size > 30_000, f"screenshot only {shot.stat().st_size} bytes"
    ids = page.eval_on_selector_all("svg.chart", "els => els.map(e => e.id)")
    assert {"chart-loss", "chart-grad_norm", "chart-step_s"} <= set(ids), ids
    # the step-time chart has one line per rank; the charts are really drawn (non-zero boxes)
    assert page.eval_on_selector_all(
        "#chart-step_s .legend", "els => els.map(e => e.textContent)"
    ) == ["rank 0", "rank 1"]
    assert page.eval_on_selector("#chart-loss", "e => e.getBoundingClientRect().width") > 300
    incidents, _ = incidents_of(report)
    rows = page.eval_on_selector_all("tr.incident", "els => els.map(e => e.innerText)")
    assert len(rows) == len(incidents) > 0
    markers = page.eval_on_selector_all("#chart-loss .incident-marker", "els => els.length")
    assert markers >= 1, "no incident marked on the loss chart"
    links = page.eval_on_selector_all("a.runbook", "els => els.map(e => e.getAttribute('href'))")
    assert links and all(
        h.startswith("file://") and h.endswith(".md") and Path(h[7:]).is_file() for h in links
    ), links
    body = page.inner_text("body")
    if kind == "crash":
        assert any("crash" in r for r in rows), rows
        assert "TrainingCrashLoop" in body or "TrainingHang" in body or "crash" in body
    else:
        # the NaN is drawn as a cross on the loss chart and the rollback is an incident
        assert page.eval_on_selector_all("#chart-loss .nonfinite", "els => els.length") >= 1
        assert any("nan" in r.lower() or "rollback" in r.lower() for r in rows), rows
        assert page.eval_on_selector_all(
            "#chart-loss .legend", "els => els.map(e => e.textContent)"
        ) == ["attempt 1", "attempt 2"], "the rollback should show as a second line"


def test_html_report_of_a_real_grpo_run_draws_the_rl_curves(browser, tmp_path):
    """A recorded real TRL GRPO run (tests/data/obs-grpo): reward, entropy and KL are drawn."""
    run = tmp_path / "obs-grpo"
    shutil.copytree(REPO / "tests" / "data" / "obs-grpo", run)
    out = tmp_path / "grpo.html"
    _diagnose_html(run, out)
    page, errors = _open(browser, out, tmp_path / "grpo.png")
    assert errors == [], errors
    titles = page.eval_on_selector_all("svg.chart .ctitle", "els => els.map(e => e.textContent)")
    assert {"RL: reward", "RL: reward_std", "RL: entropy", "RL: kl"} <= set(titles), titles
    points = page.eval_on_selector_all(
        "svg.chart polyline.series", "els => els.map(e => e.points.numberOfItems)"
    )
    assert points and min(points) >= 2, points
    assert page.eval_on_selector("#no-incidents", "e => e.textContent").startswith("No incidents")


def _hostile_report(run_dir: str, with_incidents: bool) -> tuple[dict, list[dict]]:
    metrics = [
        {
            "step": s,
            "rank": r,
            "attempt": 1,
            "loss": 3.0 - s * 0.1,
            "grad_norm": 1.0,
            "step_s": 0.1 + r * 0.05,
            "reward": 0.1 * s,
            "entropy": 2.0 - 0.05 * s,
            "kl": 0.01 * s,
            "verifier" + EVIL: 0.5,
        }
        for s in range(1, 21)
        for r in (0, 1)
    ]
    report = {
        "run_dir": run_dir,
        "recipe": EVIL,
        "config": "defaults",
        "metrics_records": len(metrics),
        "ranks": [0, 1],
        "last_step": 20,
        "findings": [
            {
                "source": "replay",
                "monitor": "entropy_collapse",
                "family": "rl",
                "step": 12,
                "rank": 0,
                "host": EVIL,
                "value": 0.1,
                "detail": "entropy fell " + EVIL,
                "severity": "warning",
                "runbook": "EntropyCollapse",
                "ts": None,
                "attempt": 1,
                "live": False,
            }
        ],
        "events_summary": {
            "state": "completed",
            "reason": EVIL,
            "attempts": 1,
            "counts": {EVIL: 1},
            "last_checkpoint_step": 20,
            "first_ts": 1.7e9,
            "last_ts": 1.7e9 + 60,
        },
        "timeline": [
            {
                "ts": 1.7e9 + 5,
                "step": 12,
                "kind": "anomaly",
                "what": "log line " + EVIL,
                "runbook": None,
            }
        ],
        "notes": [EVIL],
    }
    if with_incidents:
        report["incidents"] = [
            {
                "id": "i1",
                "kind": "crash",
                "title": "rank 1 killed " + EVIL,
                "severity": "critical",
                "ts": 1.7e9 + 10,
                "ts_end": 1.7e9 + 20,
                "attempt": 1,
                "step": 15,
                "rank": 1,
                "ranks": [1],
                "host": "h<1>",
                "evidence": ["last log line: " + EVIL, "exit -9 (SIGKILL)"],
                "runbook": "TrainingCrashLoop",
                "action": "restart " + EVIL,
                "details": {},
            },
            {
                "id": "i2",
                "kind": "entropy_collapse",
                "title": "entropy falling",
                "severity": "warning",
                "ts": 1.7e9 + 30,
                "ts_end": None,
                "attempt": 1,
                "step": None,
                "rank": None,
                "ranks": [],
                "host": None,
                "evidence": [],
                "runbook": None,
                "action": None,
                "details": {},
            },
        ]
    return report, metrics


@pytest.mark.parametrize(
    "with_incidents", [True, False], ids=["incidents-key", "findings-fallback"]
)
def test_hostile_strings_stay_text_in_chromium(browser, tmp_path, with_incidents):
    report, metrics = _hostile_report("runs/<b>bold</b>", with_incidents)
    page_html = render(report, metrics)
    assert "<script" not in page_html and "<img" not in page_html
    out = tmp_path / "evil.html"
    out.write_text(page_html)
    page, errors = _open(browser, out, tmp_path / "evil.png")
    assert errors == [], errors
    assert page.evaluate("window.__pwned === undefined")
    assert page.eval_on_selector_all("script, img", "els => els.length") == 0
    assert (
        page.eval_on_selector_all("b", "els => els.filter(e => e.textContent === 'bold').length")
        == 0
    )
    body = page.inner_text("body")
    assert EVIL in body, "the hostile text should be shown as text"
    assert "runs/<b>bold</b>" in page.title()
    # the RL curves are drawn, and the hostile metric name became a chart whose title is text
    ids = set(page.eval_on_selector_all("svg.chart", "els => els.map(e => e.id)"))
    assert {
        "chart-loss",
        "chart-grad_norm",
        "chart-step_s",
        "chart-rl-0",
        "chart-rl-1",
        "chart-rl-2",
    } <= ids
    titles = page.eval_on_selector_all("svg.chart .ctitle", "els => els.map(e => e.textContent)")
    assert "RL: reward" in titles and "RL: entropy" in titles and "RL: kl" in titles
    assert "RL: verifier" + EVIL in titles
    rows = page.eval_on_selector_all("tr.incident", "els => els.length")
    if with_incidents:
        assert rows == 2
        # i1 has a step: marked on every step chart; i2 only has a time: on the wall-clock strip
        assert page.eval_on_selector_all(
            "#chart-loss .incident-marker", "els => els.map(e => e.dataset.incident)"
        ) == ["i1"]
        assert sorted(
            page.eval_on_selector_all(
                "#chart-time .incident-marker", "els => els.map(e => e.dataset.incident)"
            )
        ) == ["i1", "i2"]
        assert (
            page.get_attribute("#incident-i1 a.runbook", "href") == "runbooks/TrainingCrashLoop.md"
        )
        assert "exit -9 (SIGKILL)" in page.inner_text("#incident-i1")
        assert "no incident grouping" not in body
    else:
        assert rows == 1
        assert page.eval_on_selector_all("#chart-loss .incident-marker", "els => els.length") == 1
        assert "no incident grouping" in body
        assert page.eval_on_selector_all("#timeline tbody tr", "els => els.length") == 1


def test_incidents_of_prefers_the_incidents_key():
    report, _ = _hostile_report("r", True)
    rows, src = incidents_of(report)
    assert src == "incidents" and [r["id"] for r in rows] == ["i1", "i2"]
    del report["incidents"]
    rows, src = incidents_of(report)
    assert src == "findings" and rows[0]["kind"] == "entropy_collapse" and rows[0]["step"] == 12


def test_series_of_ranks_that_are_no_numbers_keep_their_order():
    """A record's rank is not trusted: "--5" and "²" pass a digit test but not int()."""
    from ptops.diagnostics.html import _series

    recs = [{"step": 1, "rank": r, "loss": 1.0} for r in (10, "--5", "\u00b2", 2, "x")]
    assert list(_series(recs, "loss", "rank")) == [
        "rank 2", "rank 10", "rank --5", "rank x", "rank \u00b2"
    ]  # fmt: skip


def test_html_bad_output_path_is_one_error_line(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "rank": 0, "loss": 1.0}) + "\n")
    proc = run_ptops("diagnose", str(run), "--html", str(tmp_path), timeout=60)
    assert (
        proc.returncode == 2
        and proc.stderr.startswith("error: --html")
        and proc.stderr.count("\n") == 1
    ), proc.stderr
    out = tmp_path / "sub" / "r.html"
    proc = run_ptops("diagnose", str(run), "--html", str(out), timeout=60)
    assert proc.returncode == 0 and out.is_file() and "chart-loss" in out.read_text(), proc.stderr


def test_a_long_run_gives_a_small_page_and_keeps_its_spike():
    """100k steps x 2 ranks: the page stays small (lines are thinned) and a one-step spike is still
    drawn."""
    metrics = [
        {
            "step": s,
            "rank": r,
            "attempt": 1,
            "loss": 50.0 if s == 77_777 else 2.0 + (s % 7) * 0.01,
            "grad_norm": 1.0,
            "step_s": 0.1,
        }
        for s in range(1, 100_001)
        for r in (0, 1)
    ]
    report = {"run_dir": "long", "findings": [], "timeline": [], "events_summary": {}, "notes": []}
    page = render(report, metrics)
    assert len(page) < 400_000, len(page)
    loss = page[page.index('id="chart-loss"') : page.index('id="chart-grad_norm"')]
    ys = [float(pt.split(",")[1]) for pt in loss.split('points="')[1].split('"')[0].split()]
    assert min(ys) < 40, "the spike to 50 should reach the top of the plot"


def test_an_incident_with_only_a_time_is_marked_at_the_step_trained_then():
    metrics = [
        {"step": s, "rank": 0, "attempt": 1, "loss": 1.0, "ts": 1000.0 + s} for s in range(1, 11)
    ]
    report = {
        "run_dir": "r",
        "events_summary": {},
        "timeline": [],
        "notes": [],
        "incidents": [
            {"id": "t", "kind": "hang", "title": "x", "severity": "critical", "ts": 1006.5}
        ],
    }
    page = render(report, metrics)
    loss = page[page.index('id="chart-loss"') :]
    assert 'data-incident="t"' in loss
    marker = loss[loss.index('data-incident="t"') :]
    x = float(marker.split('x1="')[1].split('"')[0])
    # step 6 of steps 1..10 on a 682 px wide plot starting at 62
    assert abs(x - (62 + (6 - 1) / 9 * (760 - 62 - 16))) < 1, x
