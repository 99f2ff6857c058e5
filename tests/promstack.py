"""Real Prometheus + Alertmanager + a webhook receiver on 127.0.0.1, for the observability tests.

``PromStack`` starts Alertmanager (no gossip, group_wait 1s) and Prometheus (scrape and
evaluation every 1 s, ``--rules.alert.resend-delay=1s``, the shipped ptops rule file, temp
storage) scraping the given targets; alerts go to a local webhook receiver (an
``http.server`` thread) whose ``received`` list holds ``(unix_time, body)`` pairs.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from ptops.ops.obs.alerts import RULES_FILE


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for(pred, timeout: float, what: str, step: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except Exception as e:  # server not up yet
            last = e
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class WebhookReceiver:
    """Alertmanager webhook receiver on 127.0.0.1: ``received`` is a list of (unix time, body)."""

    def __init__(self) -> None:
        self.received: list[tuple[float, dict]] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                received.append((time.time(), json.loads(self.rfile.read(n))))
                self.send_response(200)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self, name: str | None = None, status: str = "firing") -> list[tuple[float, dict]]:
        """(receipt time, alert) for every alert received, optionally of one name and status."""
        return [
            (ts, a)
            for ts, body in list(self.received)
            for a in body.get("alerts", [])
            if (name is None or a["labels"].get("alertname") == name)
            and (status is None or a["status"] == status)
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def alertmanager_binary(have) -> str:
    return (
        shutil.which("prometheus-alertmanager")
        or shutil.which("alertmanager")
        or have("prometheus-alertmanager")
    )


class PromStack:
    """Alertmanager + Prometheus (shipped ptops rules) scraping ``targets`` ("host:port")."""

    def __init__(self, tmp: Path, targets: list[str], have, rules_file: Path = RULES_FILE) -> None:
        self.tmp = Path(tmp)
        self.procs: list[subprocess.Popen] = []
        prometheus = have("prometheus")
        alertmanager = alertmanager_binary(have)
        self.hook = WebhookReceiver()
        try:
            self.am_port = free_port()
            (self.tmp / "am.yml").write_text(
                yaml.safe_dump(
                    {
                        "route": {
                            "receiver": "hook",
                            "group_by": ["alertname", "run"],
                            "group_wait": "1s",
                            "group_interval": "1s",
                            "repeat_interval": "1h",
                        },
                        "receivers": [
                            {
                                "name": "hook",
                                "webhook_configs": [{"url": self.hook.url, "send_resolved": False}],
                            }
                        ],
                    }
                )
            )
            self.procs.append(
                subprocess.Popen(
                    [
                        alertmanager,
                        f"--config.file={self.tmp / 'am.yml'}",
                        f"--storage.path={self.tmp / 'am-data'}",
                        f"--web.listen-address=127.0.0.1:{self.am_port}",
                        "--cluster.listen-address=",
                    ],
                    stdout=open(self.tmp / "am.log", "w"),
                    stderr=subprocess.STDOUT,
                )
            )
            self.prom_port = free_port()
            shutil.copy(rules_file, self.tmp / "ptops-rules.yml")
            (self.tmp / "prometheus.yml").write_text(
                yaml.safe_dump(
                    {
                        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                        "rule_files": [str(self.tmp / "ptops-rules.yml")],
                        "alerting": {
                            "alertmanagers": [
                                {"static_configs": [{"targets": [f"127.0.0.1:{self.am_port}"]}]}
                            ]
                        },
                        "scrape_configs": [
                            {"job_name": "ptops", "static_configs": [{"targets": list(targets)}]}
                        ],
                    }
                )
            )
            self.procs.append(
                subprocess.Popen(
                    [
                        prometheus,
                        f"--config.file={self.tmp / 'prometheus.yml'}",
                        f"--storage.tsdb.path={self.tmp / 'prom-data'}",
                        f"--web.listen-address=127.0.0.1:{self.prom_port}",
                        "--rules.alert.resend-delay=1s",
                    ],
                    stdout=open(self.tmp / "prometheus.log", "w"),
                    stderr=subprocess.STDOUT,
                )
            )
            self.url = f"http://127.0.0.1:{self.prom_port}"
            wait_for(
                lambda: urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200,
                30,
                "prometheus ready",
            )
            wait_for(
                lambda: (
                    urllib.request.urlopen(
                        f"http://127.0.0.1:{self.am_port}/-/ready", timeout=2
                    ).status
                    == 200
                ),
                30,
                "alertmanager ready",
            )
        except BaseException:
            self.close()
            raise

    def query(self, q: str, at: float | None = None) -> list[dict]:
        """Instant query: the result vector."""
        params = {"query": q}
        if at is not None:
            params["time"] = repr(at)
        return get_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode(params))["data"][
            "result"
        ]

    def query_range(self, q: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        """Range query (what a Grafana panel sends): the result matrix."""
        params = {"query": q, "start": repr(start), "end": repr(end), "step": repr(step)}
        return get_json(f"{self.url}/api/v1/query_range?" + urllib.parse.urlencode(params))["data"][
            "result"
        ]

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs = []
        self.hook.close()
