"""The live exporter waits for one scrape after the run's last record before its endpoint goes.

Without it, Prometheus' last sample of a run is whatever it scraped up to one interval
before the launch exited: the final step, checkpoint and ``completed`` were seen or not by luck.
"""

from __future__ import annotations

import threading
import time
import urllib.request

from ptops.ops.obs import PrometheusExporter


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_last_scrape_waits_for_a_scrape_that_sees_the_end():
    ex = PrometheusExporter("r", "t", nvml=False)
    port = ex.serve(0)
    try:
        ex.observe_event({"ts": time.time(), "kind": "launch", "attempt": 1})
        _scrape(port)
        _scrape(port)  # a scraper is there (two scrapes: its interval is known)
        ex.observe_event({"ts": time.time(), "kind": "completed", "step": 16})
        seen: list[str] = []
        t = threading.Thread(
            target=lambda: (time.sleep(0.3), seen.append(_scrape(port))), daemon=True
        )
        t.start()
        t0 = time.monotonic()
        assert ex.last_scrape() is True
        assert time.monotonic() - t0 >= 0.3
        t.join(5)
        assert 'ptops_run_state{recipe="t",run="r",state="completed"} 1.0' in seen[0]
    finally:
        ex.close()


def test_last_scrape_returns_at_once_without_a_scraper():
    ex = PrometheusExporter("r", "t", nvml=False)
    ex.serve(0)
    try:
        t0 = time.monotonic()
        assert ex.last_scrape() is False
        assert time.monotonic() - t0 < 0.5
    finally:
        ex.close()
