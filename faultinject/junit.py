"""The chaos report as JUnit XML, the format every CI system (GitLab CI, GitHub Actions, Jenkins)
reads.

One ``<testcase>`` per scenario (classname = recipe, name = scenario); a failed scenario is a
``<failure>`` whose message is its problems joined; detect / recover times and the other numbers
are ``<properties>`` so a CI dashboard can chart them. Pure: report dict in, XML text out.
"""

from __future__ import annotations

import socket
import time
import xml.etree.ElementTree as ET
from typing import Any

# Result fields written as properties (the numbers a person charts; absent values are left out)
PROPERTIES = (
    "detect_s",
    "recover_s",
    "steps_recomputed",
    "restarts",
    "launches",
    "detected_by",
    "digest_equal",
    "no_lost_data",
    "no_orphans",
    "final_step",
    "state",
    "run_dir",
)


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def to_junit(report: dict[str, Any], suite: str = "ptops chaos") -> str:
    """JUnit XML (``<testsuites><testsuite>...``) of a ``chaos.run_all`` report."""
    scenarios = report.get("scenarios", [])
    failures = sum(1 for r in scenarios if not r.get("passed"))
    root = ET.Element(
        "testsuites",
        name=suite,
        tests=str(len(scenarios)),
        failures=str(failures),
        errors="0",
        time=f"{float(report.get('wall_s') or 0):.1f}",
    )
    ts = ET.SubElement(
        root,
        "testsuite",
        name=suite,
        tests=str(len(scenarios)),
        failures=str(failures),
        errors="0",
        skipped="0",
        time=f"{float(report.get('wall_s') or 0):.1f}",
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
        hostname=socket.gethostname(),
    )
    props = ET.SubElement(ts, "properties")
    ET.SubElement(props, "property", name="work_dir", value=_text(report.get("work_dir", "")))
    for recipe, base in sorted((report.get("baselines") or {}).items()):
        if isinstance(base, dict) and base.get("digest"):
            ET.SubElement(
                props, "property", name=f"baseline_digest.{recipe}", value=_text(base["digest"])
            )
    for r in scenarios:
        tc = ET.SubElement(
            ts,
            "testcase",
            classname=f"ptops.chaos.{r.get('recipe', '')}",
            name=str(r.get("scenario", "")),
            time=f"{float(r.get('wall_s') or 0):.1f}",
        )
        p = ET.SubElement(tc, "properties")
        ET.SubElement(p, "property", name="faults", value=" ".join(r.get("faults") or []))
        for key in PROPERTIES:
            if r.get(key) is not None:
                ET.SubElement(p, "property", name=key, value=_text(r[key]))
        if not r.get("passed"):
            problems = r.get("problems") or ["failed (no reason recorded)"]
            fail = ET.SubElement(
                tc, "failure", message="; ".join(problems), type="ChaosScenarioFailed"
            )
            fail.text = "\n".join(problems)
        out = (
            f"{r.get('scenario')}: detect {r.get('detect_s')} s, recover {r.get('recover_s')} "
            f"s, run {r.get('run_dir')}"
        )
        ET.SubElement(tc, "system-out").text = out
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
