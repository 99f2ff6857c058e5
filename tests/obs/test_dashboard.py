"""Grafana: dashboard built with grafana-foundation-sdk, every query valid PromQL (promtool),
Grafana-managed alert rules mirror the Prometheus rules, the shipped provisioning folder is
current, and `ptops grafana push` sends the right requests (a recording HTTP server stands in
for Grafana: no Grafana server can be installed here)."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from ptops.ops.obs import dashboard
from ptops.ops.obs.alerts import ALERTS

REQUIRED_ROWS = [
    "Run overview",
    "Throughput",
    "Loss and grad norm",
    "Checkpoints",
    "Restarts and incidents",
    "Stragglers by rank",
    "RL health",
    "GPU",
]


def test_dashboard_model():
    d = dashboard.dashboard_dict()
    assert d["uid"] == dashboard.DASHBOARD_UID and d["title"]
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == REQUIRED_ROWS
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len(panels) == len(dashboard.PANELS)
    for p in panels:
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert t["expr"] and t["refId"]
    names = [v["name"] for v in d["templating"]["list"]]
    assert names == ["datasource", "run"]
    json.loads(dashboard.dashboard_json())


def test_every_dashboard_and_grafana_rule_query_is_valid_promql(tmp_path, have):
    promtool = have("promtool")
    rules = []
    for i, (panel, expr) in enumerate(dashboard.panel_exprs(substitute=True)):
        rules.append({"record": f"ptops_dashboard_check_{i}", "expr": expr})
    group = dashboard.alert_rule_group()
    for i, r in enumerate(group["rules"]):
        for q in r["data"]:
            if q["datasourceUid"] != "__expr__":
                rules.append(
                    {
                        "record": f"ptops_grafana_rule_check_{i}_{q['refId']}",
                        "expr": q["model"]["expr"],
                    }
                )
    f = tmp_path / "exprs.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
    p = subprocess.run(
        [promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(rules)} rules found" in p.stdout


def test_grafana_rules_mirror_prometheus_rules():
    group = dashboard.alert_rule_group(
        datasource_uid="ds1", folder_uid="f1", runbook_base="https://rb.example"
    )
    assert group["title"] == dashboard.RULE_GROUP and group["folderUid"] == "f1"
    by_title = {r["title"]: r for r in group["rules"]}
    assert list(by_title) == [a.name for a in ALERTS]
    for a in ALERTS:
        r = by_title[a.name]
        assert r["for"] == a.for_ and r["labels"]["severity"] == a.severity
        assert r["condition"] == "C" and r["noDataState"] == "OK"
        assert r["annotations"]["runbook_url"] == f"https://rb.example/{a.name}.md"
        assert "$value }}" not in r["annotations"]["description"]
        a_query = next(q for q in r["data"] if q["refId"] == "A")
        assert a_query["datasourceUid"] == "ds1"
        assert a_query["model"]["expr"] == f"group without () ({a.expr})"
        assert [q["refId"] for q in r["data"]][:3] == ["A", "B", "C"]


def test_shipped_provisioning_is_current():
    for rel, text in dashboard.provisioning_files().items():
        path = dashboard.SHIPPED_PROVISIONING / rel
        assert path.is_file(), (
            f"missing {path}: run `ptops dashboard --provisioning ops/obs/grafana/provisioning`"
        )
        assert path.read_text() == text, (
            f"{path} is stale: run `ptops dashboard --provisioning ops/obs/grafana/provisioning`"
        )
    ds = yaml.safe_load((dashboard.SHIPPED_PROVISIONING / "datasources/ptops.yml").read_text())
    assert ds["datasources"][0]["uid"] == dashboard.DATASOURCE_UID
    rules = yaml.safe_load(
        (dashboard.SHIPPED_PROVISIONING / "alerting/ptops-rules.yml").read_text()
    )
    assert [r["title"] for r in rules["groups"][0]["rules"]] == [a.name for a in ALERTS]
    assert all(
        r["data"][0]["datasourceUid"] == dashboard.DATASOURCE_UID
        for r in rules["groups"][0]["rules"]
    )


def test_cli_dashboard_and_provisioning(tmp_path):
    from typer.testing import CliRunner

    from ptops.ops.cli.obs import make_app

    res = CliRunner().invoke(make_app(), ["dashboard"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["uid"] == dashboard.DASHBOARD_UID
    res = CliRunner().invoke(
        make_app(),
        [
            "dashboard",
            "--provisioning",
            str(tmp_path / "prov"),
            "--prometheus-url",
            "http://prom:9090",
        ],
    )
    assert res.exit_code == 0, res.output
    ds = yaml.safe_load((tmp_path / "prov/datasources/ptops.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prom:9090"
    assert (tmp_path / "prov/dashboards/ptops/ptops-dashboard.json").is_file()


# ---------------------------------------------------------------------- push, up to the wire


class FakeGrafana(BaseHTTPRequestHandler):
    requests: list = []
    folders: set = set()

    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        self.requests.append(
            {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
        )
        return body

    def do_GET(self):
        self._record()
        uid = self.path.rsplit("/", 1)[-1]
        if self.path.startswith("/api/folders/") and uid in self.folders:
            return self._reply(200, {"uid": uid, "title": "ptops"})
        return self._reply(404, {"message": "folder not found"})

    def do_POST(self):
        body = self._record()
        if self.path == "/api/folders":
            self.folders.add(body["uid"])
            return self._reply(200, {"uid": body["uid"], "title": body["title"]})
        if self.path == "/api/dashboards/db":
            return self._reply(
                200, {"uid": body["dashboard"]["uid"], "status": "success", "version": 1}
            )
        return self._reply(404, {"message": "not found"})

    def do_PUT(self):
        body = self._record()
        return self._reply(200, body)


@pytest.fixture
def fake_grafana():
    FakeGrafana.requests = []
    FakeGrafana.folders = set()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeGrafana)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", FakeGrafana.requests
    srv.shutdown()
    srv.server_close()


def test_grafana_push_sends_folder_dashboard_and_rule_group(fake_grafana):
    from typer.testing import CliRunner

    from ptops.ops.cli.obs import make_app

    url, reqs = fake_grafana
    for attempt in (1, 2):  # the second push finds the folder and overwrites the rest (idempotent)
        res = CliRunner().invoke(
            make_app(), ["grafana", "push", "--url", url, "--token", "glsa_T0KEN"]
        )
        assert res.exit_code == 0, res.output
        assert f"{len(ALERTS)} alert rules" in res.stdout  # every shipped rule, one each
    calls = [(r["method"], r["path"]) for r in reqs]
    assert calls == [
        ("GET", "/api/folders/ptops"),
        ("POST", "/api/folders"),
        ("POST", "/api/dashboards/db"),
        ("PUT", "/api/v1/provisioning/folder/ptops/rule-groups/ptops"),
        ("GET", "/api/folders/ptops"),
        ("POST", "/api/dashboards/db"),
        ("PUT", "/api/v1/provisioning/folder/ptops/rule-groups/ptops"),
    ]
    for r in reqs:
        assert r["headers"].get("Authorization") == "Bearer glsa_T0KEN"
    folder = reqs[1]["body"]
    assert folder == {"title": "ptops", "uid": "ptops"}
    dash = reqs[2]["body"]
    assert dash["folderUid"] == "ptops" and dash["overwrite"] is True
    assert dash["dashboard"]["uid"] == dashboard.DASHBOARD_UID
    assert len([p for p in dash["dashboard"]["panels"] if p["type"] != "row"]) == len(
        dashboard.PANELS
    )
    rg = reqs[3]
    assert rg["headers"].get("X-Disable-Provenance") == "true"
    assert (
        rg["body"]["title"] == "ptops" and rg["body"]["interval"] == dashboard.RULE_GROUP_INTERVAL_S
    )
    assert [r["title"] for r in rg["body"]["rules"]] == [a.name for a in ALERTS]
    assert all(
        r["folderUID"] == "ptops" and r["data"][0]["datasourceUid"] == "ptops-prometheus"
        for r in rg["body"]["rules"]
    )


def test_grafana_push_failure_is_one_clear_line(fake_grafana):
    from typer.testing import CliRunner

    from ptops.ops.cli.obs import make_app

    res = CliRunner().invoke(
        make_app(), ["grafana", "push", "--url", "http://127.0.0.1:1", "--token", "t"]
    )
    assert res.exit_code == 1
    assert res.output.startswith("error: grafana push to http://127.0.0.1:1 failed:")
    assert len(res.output.strip().splitlines()) == 1
