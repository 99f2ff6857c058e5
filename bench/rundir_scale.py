"""Run-directory scale: ``ptops status`` and ``ptops diagnose`` on a simulated big run directory.

    .venv/bin/python bench/rundir_scale.py --ranks 4096 --steps 150 [--rotate-mb 256] \\
        [--before b23a8e1] [--work /tmp] [--keep]

Generates a run directory as the supervisor leaves it: ``--ranks`` x ``--steps`` metrics records of
the shape of a real titan record (``bench/scale_load.py``'s ``_metrics_msg``: the keys of
tests/data/obs-titan/metrics.jsonl), written through the supervisor's own writer
(``ops/runrecord/metrics.py::MetricsWriter``: the file rotates at ``--rotate-mb``, the index is the
real one), and ``events.jsonl`` with a launch, checkpoints every 50 steps, straggler findings, a
hang naming every rank but three (with each rank's stack source, as a real hang event at scale) and
the ``failed`` end. Then times ``ptops status RUN``, ``--json``, ``ptops diagnose RUN``, ``--json``
(a fresh process each: wall time and the child's peak RSS from ``wait4``) on it and on the same
records in one unrotated ``metrics.jsonl`` (the segments concatenated: byte-identical); with
``--before REV`` also with the code of git revision REV (``git archive``, imported ahead of this
checkout) on the unrotated copy, the only layout it reads. The run directories are deleted at the
end unless ``--keep``. Results: ``bench/results/rundir_scale.json`` (one entry per size, merged).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
RESULTS = REPO / "bench" / "results" / "rundir_scale.json"
# the package-dir mapping of pyproject.toml: a REV's tree is laid out so that ``import ptops`` finds
# that tree's folders first (PYTHONPATH comes before the editable install's finder)
PACKAGE_DIRS = {
    "ops": "ops",
    "recipes": "recipes",
    "monitors": "monitors",
    "ckpt": "ckpt",
    "faultinject": "faultinject",
    "diagnostics": "diagnostics",
    "runbooks": "runbooks",
}
QUIET = (8, 10, 11)  # the ranks the hang does not name: "0-7,9,12-N"


def generate(run_path: Path, ranks: int, steps: int, rotate_mb: float, step_s: float = 1.0) -> dict:
    from scale_load import _metrics_msg

    from ptops.ops.runrecord.metrics import MetricsWriter
    from ptops.ops.runrecord.rundir import RunDir, append_jsonl

    run = RunDir(run_path).create()
    recipe = json.loads((REPO / "tests" / "data" / "obs-titan" / "recipe.json").read_text())
    recipe["name"] = f"rundir-scale-{ranks}x{steps}"
    recipe.setdefault("train", {})["steps"] = steps * 2
    run.recipe_json.write_text(json.dumps(recipe))
    t0 = 1_800_000_000.0

    def ev(ts: float, kind: str, **f) -> None:
        append_jsonl(run.events, {"ts": ts, "kind": kind, **f})

    ev(t0, "launch", attempt=1, nproc=ranks, nodes=[f"n{i}" for i in range(ranks // 8)])
    w = MetricsWriter(run.path, rotate_bytes=int(rotate_mb * 1024 * 1024))
    t = time.monotonic()
    for step in range(1, steps + 1):
        ts = t0 + 30 + step * step_s
        for rank in range(ranks):
            w.append(_metrics_msg(rank, 1, step, step_s * (1.6 if rank == 9 else 1.0), ts)["rec"])
        if step % 50 == 0:
            ev(
                ts + 0.1,
                "checkpoint",
                step=step,
                path=f"checkpoints/step-{step}",
                blocking_s=0.2,
                total_s=3.0,
                attempt=1,
            )
        if step in (20, steps // 2):
            ev(
                ts + 0.2,
                "straggler",
                attempt=1,
                rank=9,
                ratio=1.6,
                step=step,
                monitor="straggler",
                host="n1",
            )
    w.close()
    gen_s = time.monotonic() - t
    hung = [r for r in range(ranks) if r not in QUIET]
    end = t0 + 30 + steps * step_s
    ev(
        end + 60,
        "hang",
        attempt=1,
        ranks=hung,
        step=steps + 1,
        silent_s=60.0,
        phase="step",
        section="step",
        timeout_s=10.0,
        stalled=hung,
        why="no progress",
        found_ts=end + 55,
        stacks=str(run.path / "stacks" / "attempt-1"),
        stack_sources={str(r): "own dump" for r in range(ranks)},
        stacks_s=4.2,
        teardown_s=1.1,
    )
    ev(end + 61, "failed", attempt=1, reason="hang")
    size = sum(f.stat().st_size for f in run.path.rglob("*") if f.is_file())
    return {"generate_s": round(gen_s, 1), "bytes": size, "rotations": w.rotations}


def unrotated_copy(src: Path, dst: Path) -> None:
    """The same run with its segments and live file in one ``metrics.jsonl`` (byte-identical)."""
    from ptops.ops.runrecord.metrics import segments

    dst.mkdir(mode=0o700)
    for f in ("events.jsonl", "recipe.json"):
        shutil.copy(src / f, dst / f)
    with open(dst / "metrics.jsonl", "wb") as out:
        for seg in segments(src):
            with open(seg.path, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
        with open(src / "metrics.jsonl", "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)


def tree_of(rev: str, where: Path) -> Path:
    """REV's tree laid out as an importable ``ptops`` package; returns the PYTHONPATH entry."""
    raw = where / "src"
    raw.mkdir()
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True)
    path = where / "rev.tar"
    path.write_bytes(tar.stdout)
    with tarfile.open(path) as tf:
        tf.extractall(raw, filter="data")
    pkg = where / "pkg" / "ptops"
    shutil.copytree(raw / "ptops", pkg)
    for name, folder in PACKAGE_DIRS.items():
        (pkg / name).symlink_to(raw / folder)
    return where / "pkg"


def measure(run_path: Path, pythonpath: Path | None, timeout: float) -> dict:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    out = {}
    for name, args in (
        ("status", ["status", str(run_path)]),
        ("status_json", ["status", str(run_path), "--json"]),
        ("diagnose", ["diagnose", str(run_path)]),
        ("diagnose_json", ["diagnose", str(run_path), "--json"]),
    ):
        t = time.monotonic()
        with tempfile.TemporaryFile() as so, tempfile.TemporaryFile() as se:
            p = subprocess.Popen(
                [sys.executable, "-m", "ptops", *args], stdout=so, stderr=se, env=env, cwd="/"
            )
            try:
                _, status, ru = os.wait4(p.pid, 0)
            except KeyboardInterrupt:
                p.kill()
                raise
            p.returncode = os.waitstatus_to_exitcode(status)
            wall = time.monotonic() - t
            so.seek(0), se.seek(0)
            text, err = so.read(), se.read()
        row = {
            "wall_s": round(wall, 2),
            "peak_rss_mb": round(ru.ru_maxrss / 1024, 1),
            "rc": p.returncode,
            "stdout_bytes": len(text),
            "longest_line": max((len(x) for x in text.splitlines()), default=0),
        }
        if p.returncode not in (0, 1):
            row["stderr"] = err.decode(errors="replace")[-400:]
        out[name] = row
        print(
            f"  {name:14s} {row['wall_s']:7.2f} s  {row['peak_rss_mb']:8.1f} MB  rc {row['rc']}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rotate-mb", type=float, default=256.0)
    ap.add_argument("--before", default=None, help="a git revision to time as well (unrotated)")
    ap.add_argument("--work", default=tempfile.gettempdir())
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument(
        "--no-unrotated", action="store_true", help="time the rotated run directory only"
    )
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rundir-scale-", dir=a.work))
    key = f"{a.ranks}x{a.steps}@{a.rotate_mb:g}MB"
    res: dict = {
        "ranks": a.ranks,
        "steps": a.steps,
        "rotate_mb": a.rotate_mb,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0],
    }
    try:
        rotated, plain = work / "rotated", work / "plain"
        print(f"generating {key} in {work}", flush=True)
        res["generated"] = generate(rotated, a.ranks, a.steps, a.rotate_mb)
        res["records"] = a.ranks * a.steps
        unrotated_copy(rotated, plain)
        res["metrics_bytes"] = (plain / "metrics.jsonl").stat().st_size
        print(json.dumps(res["generated"]), flush=True)
        print("after, rotated:", flush=True)
        res["after_rotated"] = measure(rotated, None, a.timeout)
        if not a.no_unrotated:
            print("after, one metrics.jsonl:", flush=True)
            res["after_unrotated"] = measure(plain, None, a.timeout)
        if a.before:
            res["before_rev"] = a.before
            print(f"before ({a.before}), one metrics.jsonl:", flush=True)
            res["before_unrotated"] = measure(plain, tree_of(a.before, work), a.timeout)
        res["load_after"] = os.getloadavg()[0]
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    prev = old.get(key, {})
    if not a.before and "before_unrotated" in prev:  # the same records' earlier "before" run
        res["before_rev"], res["before_date"] = prev.get("before_rev"), prev.get("date")
        res["before_unrotated"] = prev["before_unrotated"]
    old[key] = res
    RESULTS.write_text(json.dumps(old, indent=1) + "\n")
    print(f"wrote {RESULTS} [{key}]")


if __name__ == "__main__":
    main()
