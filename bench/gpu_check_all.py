"""The GPU check's stages, each in its own process group under a time budget
(``scripts/gpu_check.sh`` installs the carried wheels, then runs this). A stage that overruns is cut
(SIGTERM, then SIGKILL to its whole process group) and recorded as ``cut``; the others still run.
The whole check stays under ``--budget`` seconds (default 480: one device call of ``timeout_s=560``
with time to spare).

Stages (each writes its own ``bench/results/gpu_check*.json`` as it goes):

1. ``script``: the own-script engine on CUDA, one rank (``bench/gpu_check_script.py``)
2. ``trl``: TRL recipes on CUDA, uninterrupted vs SIGKILLed, digests equal
   (``bench/gpu_check_trl.py``)
3. ``titan``:  float8 + compile + async pinned saves (``bench/gpu_check.py``), only where TorchTitan
               imports: else ``skipped`` with the reason

``bench/results/gpu_check_summary.json``: ``when``, ``versions`` (python, torch, CUDA, GPU, ptops'
key dependencies), ``budget_s``, ``stages`` (name -> ``status`` ok | failed | cut | skipped, ``rc``,
``wall_s``, ``budget_s``, ``result`` (its JSON), ``reason`` when skipped, ``tail`` of its output).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
# recipes not yet run on a GPU first (sft, dpo, grpo, lora-sft, gkd were exact on the H200,
# 2026-11-30)
TRL_RECIPES = "trl-reward-tiny,trl-rloo-tiny,trl-grpo-math-tiny"
BUDGETS = {"script": 180, "trl": 270, "titan": 200}


def run_stage(name: str, argv: list[str], budget: float, log: Path | None = None) -> dict:
    """``argv`` in a new session, cut after ``budget`` seconds: {status, rc, wall_s, budget_s,
    tail}."""
    t0 = time.monotonic()
    with open(log, "a") if log else open(os.devnull, "w") as sink:
        sink.write(f"\n=== stage {name}: {' '.join(argv)} (budget {budget:.0f} s)\n")
        sink.flush()
        p = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        cut = False
        try:
            out, _ = p.communicate(timeout=max(1.0, budget))
        except subprocess.TimeoutExpired:
            cut = True
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            try:
                os.killpg(p.pid, signal.SIGKILL)  # what the stage left running in its group
            except ProcessLookupError:
                pass
            out, _ = p.communicate()
        sink.write(out or "")
    status = "cut" if cut else ("ok" if p.returncode == 0 else "failed")
    return {
        "status": status,
        "rc": p.returncode,
        "wall_s": round(time.monotonic() - t0, 1),
        "budget_s": round(budget),
        "tail": (out or "").strip().splitlines()[-6:],
    }


def titan_why_not(py: str = sys.executable) -> str | None:
    """None when TorchTitan's trainer imports with this torch, else why the stage is skipped."""
    code = (
        "import torch, sys\nprint(torch.__version__)\n"
        "try:\n    import torchtitan.train\nexcept Exception as e:\n"
        "    print(type(e).__name__ + (': ' + str(e).splitlines()[0] if str(e) else ''))\n"
        "    sys.exit(3)\n"
    )
    try:
        p = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=180, cwd=REPO)
    except subprocess.TimeoutExpired:
        return "importing torchtitan.train took over 180 s"
    lines = p.stdout.strip().splitlines()
    if p.returncode == 0:
        return None
    torch = lines[0] if lines else "?"
    err = lines[-1] if len(lines) > 1 else (p.stderr.strip().splitlines() or ["?"])[-1]
    if "No module named 'torchtitan'" in err:
        return (
            f"torchtitan is not installed (torch {torch}); TorchTitan 0.3 needs torch >= 2.13 "
            "(on torch 2.11 it does not import: DataParallelMeshDims), and a torch CUDA wheel "
            "cannot be "
            "carried"
        )
    return f"torchtitan does not import on torch {torch}: {err}"


def versions(py: str = sys.executable) -> dict:
    code = (
        "import json, importlib.metadata as md, platform\nout = {'python': "
        "platform.python_version()}\n"
        "for n in ('torch', 'transformers', 'trl', 'datasets', 'accelerate', 'peft', 'tokenizers',"
        " 'ptops',"
        " 'nvidia-ml-py', 'pydantic', 'py-spy'):\n"
        "    try: out[n] = md.version(n)\n    except Exception: out[n] = None\n"
        "import torch\nout['cuda'] = torch.version.cuda\n"
        "out['gpu'] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None\n"
        "print(json.dumps(out))\n"
    )
    try:
        p = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=180)
        return json.loads(p.stdout)
    except (ValueError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)[-300:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("runs", nargs="?", default="/tmp/ptops-gpu-check", help="where the runs go")
    ap.add_argument(
        "--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", 480))
    )
    ap.add_argument("--stages", default="script,trl,titan")
    ap.add_argument("--trl-recipes", default=TRL_RECIPES)
    ap.add_argument("--log", default="", help="append every stage's output here")
    a = ap.parse_args(argv)
    t_end = time.monotonic() + a.budget
    runs = Path(a.runs)
    runs.mkdir(parents=True, exist_ok=True)
    log = Path(a.log) if a.log else None
    out = RESULTS / "gpu_check_summary.json"
    res: dict = {
        "when": time.strftime("%Y%m%d-%H%M%S"),
        "versions": versions(),
        "budget_s": a.budget,
        "stages": {},
    }

    def write() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")

    py = sys.executable
    plan = {
        "script": (
            [py, "bench/gpu_check_script.py", str(runs / "script")],
            "bench/results/gpu_check_script.json",
        ),
        "trl": (
            [py, "bench/gpu_check_trl.py", str(runs / "trl"), "--recipes", a.trl_recipes],
            "bench/results/gpu_check_trl.json",
        ),
        "titan": ([py, "bench/gpu_check.py", str(runs / "titan")], "bench/results/gpu_check.json"),
    }
    for name in a.stages.split(","):
        argv_, result = plan[name]
        left = t_end - time.monotonic() - 5
        if name == "titan" and (why := titan_why_not(py)) is not None:
            res["stages"][name] = {"status": "skipped", "reason": why}
        elif left < 20:
            res["stages"][name] = {
                "status": "cut",
                "reason": f"no time left ({left:.0f} s of {a.budget:.0f})",
            }
        else:
            res["stages"][name] = {
                **run_stage(name, argv_, min(BUDGETS[name], left), log),
                "result": result,
            }
        st = res["stages"][name]
        took = f" {st['wall_s']} s" if "wall_s" in st else ""
        why = f" ({st['reason']})" if "reason" in st else ""
        print(f"gpu_check: {name}: {st['status']}{took}{why}", flush=True)
        write()
    res["ok"] = all(s["status"] in ("ok", "skipped") for s in res["stages"].values())
    write()
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
