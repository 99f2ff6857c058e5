"""Chaos scenarios: inject a fault into a real supervised run and check it heals to the fault-free
result.

A scenario is a recipe, one or more fault specs and the event kinds that count as
the fault being *detected*. For each scenario the runner:

1. runs ``ptops launch RECIPE --supervise --run-dir DIR --set ... --fault ...`` in a
   subprocess (the supervisor may be SIGKILLed by a ``kill-supervisor`` fault, so it
   cannot live in this process);
2. when that launch ends the way a scheduler's job does without finishing --
   preempted (exit 143 after SIGTERM) or the supervisor killed (-9 / 137) -- it
   *resumes*: reruns exactly the same launch command on the same run directory
   (what a requeue does). The faults fire in the first attempt only, so the rerun
   runs clean; a rerun adopts the run (``adopt`` event) when its supervisor died;
3. reads ``events.jsonl`` / ``metrics.jsonl`` and measures, against a fault-free
   baseline of the same recipe, seed and settings (run once per recipe per
   invocation):

   - **detect_s**: first ``fault_injected`` ts -> first detection event ts (crash,
     hang, straggler, anomaly, checkpoint_failed, checkpoint_invalid, stopped,
     adopt, ... per scenario);
   - **recover_s**: fault -> first rank-0 step recorded by a later attempt (the
     first productive step after the restart / relaunch); ``None`` when the run
     healed without a restart;
   - **steps_recomputed**: rank-0 step records beyond one per step (steps done again
     after resuming from an older checkpoint);
   - **digest_equal**: ``ptops ckpt digest`` of the final checkpoint equals the
     baseline's (bit-identical model and optimizer state);
   - **no_lost_data**: every step 1..N has a final rank-0 metrics record with a
     finite loss, and the final checkpoint (step N) verifies (deep);
   - **no_orphans**: no process of the run is left;
   - **ranks_from**: each launch's ``warm`` / ``cold`` (the ``launch`` event). Crash scenarios run
     with ``warm_spare=true``; a restart that went cold although the run kept a warm pool is a
     problem.

   A scenario passes when its fault fired, the last launch exited 0 with the run
   ``completed``, it was detected (where detection is expected), there is no lost
   data, no orphan, and the digest equals the baseline's.

Imports ptops.ops (to find processes) and ptops.ckpt (digest, verify); torch only
inside digest.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ptops.faultinject.spec import FaultSpecError, parse
from ptops.ops.runrecord.events import EventKind, reduce
from ptops.ops.runrecord.jsonl import read_jsonl
from ptops.ops.runrecord.rundir import RunDir
from ptops.ops.runrecord.status import read_status_file

STEPS = 12
INTERVAL = 4
# small runs and tight supervisor timeouts: one scenario takes 20-60 s on 2 cores
COMMON_SETS = (
    f"train.steps={STEPS}",
    f"checkpoint.interval={INTERVAL}",
    "supervisor.hang.floor_s=5",
    "supervisor.hang.ping_stale_s=4",
    "supervisor.restart.backoff_s=0.5",
    "supervisor.kill_timeout_s=5",
    "supervisor.stack_timeout_s=3",
)

# kind -> (fault specs, detection event kinds, needs a relaunch)
KIND_SCENARIOS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "crash": (("crash:rank=1,step=6",), ("crash",)),
    "hang": (("hang:rank=0,step=6",), ("hang",)),
    "slow": (("slow:rank=1,step=3,seconds=0.5,steps=8",), ("straggler",)),
    "nan": (("nan:step=6",), ("anomaly", "crash", "rollback")),  # + KIND_SETS["nan"]
    "oom": (("oom:rank=0,step=6",), ("crash",)),
    # a corrupt checkpoint only matters when a restart needs it: crash after it so the restart
    # must notice the damage, quarantine it and fall back to the previous good checkpoint
    "corrupt-ckpt": (
        ("corrupt-ckpt:step=8,mode=flip", "crash:rank=1,step=10"),
        ("checkpoint_invalid",),
    ),
    "enospc": (("enospc:step=8",), ("checkpoint_failed", "crash")),
    # a rank killed in the middle of a save: the half-written step-8 is never committed; the
    # restart quarantines it (or, TRL, passes over it) and resumes from step 4
    "crash-in-save": (("crash:phase=save,rank=1,step=8",), ("crash",)),
    "preempt": (("preempt:step=6",), ("stopped",)),
    "kill-supervisor": (("kill-supervisor:step=6",), ("adopt",)),
    # silent data corruption: rank 1 flips a bit of a parameter before step 11, in the at-rest
    # window after step 10 (KIND_SETS: monitors.sdc.every=10); the exact rollback to step 8 must
    # end on the baseline's digest. Held before step 12 so the run cannot finish (and commit its
    # corrupt final checkpoint) before the supervisor acts on step 11's record.
    "bitflip": (("bitflip:rank=1,step=11", "hold:step=12,seconds=60"), ("anomaly", "rollback")),
    # a gradient flipped at step 10, after the backward: on FSDP shards (titan) the step's recheck
    # (KIND_SETS) outvotes it before the optimizer, no rollback; on DDP replicas (TRL) rank 1's
    # weights part from rank 0's and the fingerprints of step 10 disagree: an exact rollback to
    # before step 5, the last agreement (RECIPE_OVERRIDES hold TRL runs before step 11)
    "bitflip-grad": (("bitflip:rank=1,step=10,target=grad",), ("anomaly",)),
}
# The seams of a vLLM engine (GRPO / RLOO with ``--set trl.vllm.mode=...``, vLLM installed, e.g.
# ``.venv-vllm/bin/ptops chaos --recipe trl-grpo-tiny --set trl.vllm.mode=colocate --scenario
# stale-sync --scenario sync-hang``): not in the default matrix, which has no engine
ENGINE_KIND_SCENARIOS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # the sync before step 6 changes nothing: the seam's check finds it in its step, syncs again
    "stale-sync": (("stale-sync:step=6",), ("engine_resync",)),
    # a hang inside the weight sync before step 6: found on the step's budget, phase engine_sync
    "sync-hang": (("sync-hang:step=6",), ("hang",)),
    # server mode: the engine's process dies before step 6's rollouts; restarted, synced, the same
    # rollouts generated (no rank restarts)
    "engine-crash": (("engine-crash:step=6",), ("sidecar_died",)),
    # the engine stops answering before step 6's rollouts: server mode, its failed health checks
    # replace it (sidecar_died), re-synced, the same rollouts; colocate, a hang in engine_generate
    "engine-hang": (("engine-hang:step=6",), ("sidecar_died", "hang")),
}
# The grader seam of GRPO / RLOO (recipes/trl/grader.py), engine or not: in the default matrix for
# trl-grpo-tiny only (the other tiny recipes have no grader)
RL_KIND_SCENARIOS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # rank 1's reward call for step 6 fails as a dead grader's does; its retry scores as an
    # uninterrupted run (no verdict lost, no rank restarted)
    "grader-crash": (("grader-crash:rank=1,step=6",), ("grader_failed",)),
    # rank 0 stalls inside step 6's reward call: a hang in phase reward, restarted from step 4
    "grader-timeout": (("grader-timeout:rank=0,step=6",), ("hang",)),
}
# A NaN rollback skips the poisoned step's batch by default (monitors.rollback.skip_batches=1): a
# deliberate change of the data order, so the result cannot equal the baseline. The injected NaN is
# transient (attempt 1 only): replaying the same data is the comparison that can be bit-identical.
KIND_SETS: dict[str, tuple[str, ...]] = {
    "nan": ("monitors.rollback.skip_batches=0",),
    # a crash's restart should be a fast one: its ranks forked from the warm pool, which `auto`
    # leaves off on small boxes; a restart that went cold although the pool was on is a problem
    # (``cold_restarts``)
    "crash": ("supervisor.restart.warm_spare=true",),
    # the flip before step 11 lands in the at-rest window after step 10 at this cadence, whatever
    # the default
    "bitflip": ("monitors.sdc.every=10",),
    "bitflip-grad": ("monitors.sdc.every=5", "monitors.sdc.recheck_every=5"),
}
# why a launch of a run that keeps a warm pool may still start cold (the launch event's cold_why);
# any other reason (the pool exited, or never became ready) is a failed fast restart
COLD_OK = ("no_pool", "pool_not_started", "pool_declined", "stopping")
ALL_KINDS = tuple(KIND_SCENARIOS)
# The default matrix: every fault kind on these tiny recipes (TorchTitan and TRL's SFT, DPO and GRPO
# trainers; each kind applies to both engines: the faults act through the probe and the checkpoint
# layer, which both adapters share). Not every shipped tiny recipe: the others run with ``--recipe
# NAME``. ``ptops chaos --help`` names these from this tuple (tests/chaos/test_chaos.py checks it).
TINY_RECIPES = ("titan-tiny", "trl-sft-tiny", "trl-dpo-tiny", "trl-grpo-tiny")
DEFAULT_MATRIX: dict[str, tuple[str, ...]] = {
    r: ALL_KINDS + (tuple(RL_KIND_SCENARIOS) if r == "trl-grpo-tiny" else ()) for r in TINY_RECIPES
}


def default_recipes_help() -> str:
    """What ``--recipe``'s default covers, in words, from the same table ``select`` uses."""
    names = list(DEFAULT_MATRIX)
    return (
        f"Default: the default matrix, every fault kind on these {len(names)} tiny recipes: "
        f"{', '.join(names)} (not every shipped tiny recipe: run any other, e.g. one `ptops "
        "recipes` "
        "lists, with --recipe NAME)."
    )


TRL_KINDS = ALL_KINDS
# per recipe tweaks of a kind's faults (TRL: truncate instead of flip, so both modes are exercised)
RECIPE_OVERRIDES: dict[tuple[str, str], tuple[str, ...]] = {
    **{
        (r, "corrupt-ckpt"): ("corrupt-ckpt:step=8,mode=truncate", "crash:rank=1,step=10")
        for r in TINY_RECIPES
        if r.startswith("trl")
    },
    **{
        (r, "bitflip-grad"): ("bitflip:rank=1,step=10,target=grad", "hold:step=11,seconds=60")
        for r in TINY_RECIPES
        if r.startswith("trl")
    },
}
DETECT_KINDS_ANY = (
    "crash",
    "hang",
    "straggler",
    "anomaly",
    "checkpoint_failed",
    "checkpoint_invalid",
    "stopped",
    "adopt",
    "rollback",
)
RELAUNCH_CODES = (143, 128 + 9, -9, -15)  # preempted, supervisor killed: what a requeue reruns
MAX_RELAUNCHES = 3
PROGRESS_EVERY_S = 15.0


class ScenarioError(ValueError):
    """A bad --scenario / --recipe selection (one line)."""


@dataclass
class Scenario:
    name: str  # "titan-tiny/crash"
    recipe: str  # the recipe's short name (scenario and folder names)
    kind: str
    faults: tuple[str, ...]
    detect: tuple[str, ...]
    sets: tuple[str, ...] = COMMON_SETS  # shared with the baseline
    extra_sets: tuple[str, ...] = ()  # this scenario only (settings a fault-free run never uses)
    recipe_path: str = ""  # the file to launch ("" = the shipped recipe of that name)

    def launch_argv(self, run_dir: Path, faults: bool = True) -> list[str]:
        # --no-mlflow: the exporters are not under test, and their start-up would blur the timings
        argv = [
            sys.executable,
            "-m",
            "ptops",
            "launch",
            self.recipe_path or self.recipe,
            "--supervise",
            "--run-dir",
            str(run_dir),
            "--json",
            "--no-mlflow",
        ]
        for s in self.sets:
            argv += ["--set", s]
        if faults:
            for s in self.extra_sets:
                argv += ["--set", s]
            for f in self.faults:
                argv += ["--fault", f]
        return argv


@dataclass
class Result:
    scenario: str
    recipe: str
    kind: str
    faults: list[str]
    passed: bool = False
    problems: list[str] = field(default_factory=list)
    fired: bool = False
    detected_by: str | None = None
    detect_s: float | None = None
    recover_s: float | None = None
    steps_recomputed: int | None = None
    restarts: int = 0
    ranks_from: list[str] = field(default_factory=list)  # each attempt's launch: "warm" or "cold"
    launches: int = 0
    exit_codes: list[int] = field(default_factory=list)
    state: str | None = None
    final_step: int = 0
    final_loss: float | None = None
    digest: str | None = None
    baseline_digest: str | None = None
    digest_equal: bool | None = None
    no_lost_data: bool = False
    no_orphans: bool = True
    wall_s: float = 0.0
    run_dir: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- selection
def scenario_for(
    recipe: str,
    kind: str,
    faults: tuple[str, ...] | None = None,
    recipe_path: str = "",
    sets: tuple[str, ...] = (),
) -> Scenario:
    """``sets``: the user's ``--set`` for every launch, the baseline's too."""
    known = {**KIND_SCENARIOS, **RL_KIND_SCENARIOS, **ENGINE_KIND_SCENARIOS}
    if faults is None:
        if kind not in known:
            raise ScenarioError(
                f"unknown scenario kind {kind!r} (expected one of: {', '.join(known)}, or a "
                "fault spec)"
            )
        faults = RECIPE_OVERRIDES.get((recipe, kind), known[kind][0])
        detect = known[kind][1]
        name = f"{recipe}/{kind}"
    else:
        detect = known.get(kind, ((), DETECT_KINDS_ANY))[1]
        name = f"{recipe}/{','.join(faults)}" if len(faults) > 1 else f"{recipe}/{faults[0]}"
    return Scenario(
        name=name,
        recipe=recipe,
        kind=kind,
        faults=tuple(faults),
        detect=tuple(detect),
        sets=COMMON_SETS + tuple(sets),
        extra_sets=KIND_SETS.get(kind, ()),
        recipe_path=recipe_path,
    )


def _resolve(recipe: str) -> tuple[str, str]:
    """``titan-tiny``, ``recipes/titan-tiny.toml`` or an absolute path -> (short name, file): the
    launch's resolver."""
    from ptops.recipes.schema import RecipeError, resolve

    try:
        ref = resolve(recipe)
    except RecipeError as e:
        raise ScenarioError(f"--recipe {recipe!r}: {e}") from None
    return ref.name, str(ref.path)


def select(
    recipes: Iterable[str] = (), scenarios: Iterable[str] = (), sets: Iterable[str] = ()
) -> list[Scenario]:
    """``--recipe R``... and ``--scenario S``... -> scenarios.

    R is a shipped recipe's name or a recipe file (as ``ptops launch`` takes it). S is
    ``RECIPE/KIND`` (``titan-tiny/crash``), ``KIND`` (for every selected recipe), or a fault
    spec with or without ``RECIPE/`` (``titan-tiny/crash:rank=0,step=3``) for a custom
    scenario. No S: the default matrix of the selected recipes (all of them without --recipe).
    ``sets``: ``--set`` for every launch (the baselines' too).
    """
    sets = tuple(sets)
    paths: dict[str, str] = {}
    for r in dict.fromkeys(recipes):
        name, path = _resolve(r)
        paths.setdefault(name, path)
    recipes = list(paths)
    scenarios = list(scenarios)
    pool = recipes or list(DEFAULT_MATRIX)
    out: list[Scenario] = []
    if not scenarios:
        for r in pool:
            for k in DEFAULT_MATRIX.get(r, TRL_KINDS if r.startswith("trl") else ALL_KINDS):
                out.append(scenario_for(r, k, recipe_path=paths.get(r, ""), sets=sets))
    for s in scenarios:
        text = s.strip()
        head = text.split(":", 1)[0]
        if "/" in head:
            rec = head.rpartition("/")[0]
            what = text[len(rec) + 1 :]
            if rec not in paths:
                name, path = _resolve(rec)
                paths.setdefault(name, path)
                rec = name
            targets = [rec]
        else:
            what = text
            targets = (
                recipes
                or [r for r in DEFAULT_MATRIX if what in DEFAULT_MATRIX[r]]
                or list(DEFAULT_MATRIX)
            )
        if not what:
            raise ScenarioError(
                f"--scenario {s!r}: expected RECIPE/KIND, KIND or a fault spec (e.g. "
                "titan-tiny/crash)"
            )
        for rec in targets:
            if ":" in what:
                specs = tuple(x.strip() for x in what.split(";") if x.strip())
                try:
                    kinds = [parse(x).kind for x in specs]
                except FaultSpecError as e:
                    raise ScenarioError(f"--scenario {s!r}: {e}") from None
                out.append(
                    scenario_for(rec, kinds[0], specs, recipe_path=paths.get(rec, ""), sets=sets)
                )
            else:
                try:
                    out.append(scenario_for(rec, what, recipe_path=paths.get(rec, ""), sets=sets))
                except ScenarioError as e:
                    raise ScenarioError(f"--scenario {s!r}: {e}") from None
    seen: set[str] = set()
    unique = []
    for sc in out:
        if sc.name not in seen:
            seen.add(sc.name)
            unique.append(sc)
    return unique


def check_recipes(scenarios: list[Scenario]) -> None:
    from ptops.recipes.schema import RecipeError, load

    for r, sets in dict.fromkeys((sc.recipe_path or sc.recipe, sc.sets) for sc in scenarios):
        try:
            load(r, list(sets))
        except RecipeError as e:
            raise ScenarioError(f"--recipe {r!r}: {e}") from None


# ---------------------------------------------------------------- run directory reading
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return list(read_jsonl(path))


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def analyze(
    events: list[dict], metrics: list[dict], steps: int, detect: tuple[str, ...]
) -> dict[str, Any]:
    """Pure: timings and data checks from a run's records (see the module docstring)."""
    out: dict[str, Any] = {}
    view = reduce(events)
    # a hold is a pause some scenarios take before their fault, not the fault: timings start at the
    # fault
    faults = [
        e
        for e in events
        if e.get("kind") == EventKind.FAULT_INJECTED
        and not str(e.get("fault", "")).startswith("hold")
    ]
    out["fired"] = bool(faults)
    out["restarts"] = view.restarts
    launches = [e for e in events if e.get("kind") == EventKind.LAUNCH]
    out["ranks_from"] = [str(e.get("ranks_from") or "cold") for e in launches]
    out["cold_restarts"] = [
        f"attempt {e.get('attempt')} started cold although the run keeps a warm pool "
        f"({e.get('cold_why')}: "
        f"{e.get('cold_detail', '')})"
        for e in launches
        if e.get("warm_pool") and e.get("ranks_from") == "cold" and e.get("cold_why") not in COLD_OK
    ]
    out["state"] = view.end["kind"] if view.end else None
    r0 = [m for m in metrics if m.get("rank") == 0 and isinstance(m.get("step"), int)]
    final: dict[int, dict] = {}
    for m in r0:
        final[m["step"]] = m
    out["final_step"] = max(final, default=0)
    last = final.get(out["final_step"], {})
    out["final_loss"] = last.get("loss") if _finite(last.get("loss")) else None
    missing = [s for s in range(1, steps + 1) if s not in final]
    bad_loss = [s for s in range(1, steps + 1) if s in final and not _finite(final[s].get("loss"))]
    out["missing_steps"] = missing
    out["nonfinite_steps"] = bad_loss
    out["steps_recomputed"] = max(
        0,
        len([m for m in r0 if 1 <= m["step"] <= steps])
        - len([s for s in final if 1 <= s <= steps]),
    )
    out["detected_by"] = out["detect_s"] = out["recover_s"] = None
    if not faults:
        return out
    t0 = float(faults[0]["ts"])
    fault_attempt = int(faults[0].get("attempt") or 1)
    for e in events:
        if e.get("kind") in detect and float(e["ts"]) >= t0 - 1e-6:
            out["detected_by"] = e["kind"]
            out["detect_s"] = round(float(e["ts"]) - t0, 2)
            break
    later = [
        m for m in r0 if int(m.get("attempt") or 1) > fault_attempt and float(m.get("ts", 0)) >= t0
    ]
    if later:
        out["recover_s"] = round(min(float(m["ts"]) for m in later) - t0, 2)
    return out


def final_checkpoint(run_dir: Path, steps: int) -> Path | None:
    from ptops.ckpt import checkpoint_path

    return checkpoint_path(run_dir, steps)


def digest_of(run_dir: Path, steps: int) -> tuple[str | None, str]:
    """(digest of the final checkpoint, problem) -- what ``ptops ckpt digest`` prints for it."""
    from ptops.ckpt import digest

    ck = final_checkpoint(run_dir, steps)
    if ck is None:
        return None, f"no final checkpoint (step {steps}) in {run_dir / 'checkpoints'}"
    try:
        return digest(ck), ""
    except Exception as e:  # DigestError, OSError, ...: the checkpoint is unreadable
        return None, f"digest of {ck} failed: {type(e).__name__}: {e}"


def verify_final(run_dir: Path, steps: int) -> tuple[bool, str]:
    from ptops.ckpt import verify

    ck = final_checkpoint(run_dir, steps)
    if ck is None:
        return False, f"no final checkpoint (step {steps})"
    r = verify(ck, deep=True)
    return r.ok, "" if r.ok else f"final checkpoint {ck.name} does not verify: {r.reason}"


def _orphans(run_dir: Path) -> list[int]:
    try:
        from ptops.ops.supervisor.procs import run_processes

        return run_processes(run_dir)
    except Exception:
        return []


# ---------------------------------------------------------------- running
class Runner:
    def __init__(
        self,
        work_dir: Path,
        progress: Callable[[str], None] | None = None,
        launch_timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
    ):
        self.work_dir = Path(work_dir)
        self.progress = progress or (lambda msg: None)
        self.launch_timeout_s = launch_timeout_s
        self.env = env
        self.baselines: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}

    def _wait(self, proc: subprocess.Popen, run_dir: Path, label: str) -> int:
        """Wait for the launch, with a progress line from the run's status.json every
        PROGRESS_EVERY_S."""
        deadline = time.monotonic() + self.launch_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, self.launch_timeout_s)
            try:
                return proc.wait(timeout=min(PROGRESS_EVERY_S, left))
            except subprocess.TimeoutExpired:
                st = read_status_file(RunDir(run_dir))
                self.progress(
                    f"{label}: {st.get('state', 'starting')}, attempt {st.get('attempt', '?')}, "
                    f"step {st.get('step', 0)}/{st.get('total_steps', '?')}"
                )

    def _launch(
        self, argv: list[str], log: Path, run_dir: Path | None = None, label: str = ""
    ) -> int:
        env = dict(os.environ)
        env.update(self.env or {})
        with open(log, "ab") as out:
            out.write(f"\n$ {' '.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                if run_dir is None:
                    return proc.wait(timeout=self.launch_timeout_s)
                return self._wait(proc, run_dir, label)
            except subprocess.TimeoutExpired:
                _stop(proc)
                return 124
            except (
                KeyboardInterrupt
            ):  # Ctrl-C on chaos: the launch runs in its own session; stop it too
                _stop(proc)
                raise

    def baseline(self, sc: Scenario) -> dict[str, Any]:
        key = (sc.recipe, sc.sets)
        if key in self.baselines:
            return self.baselines[key]
        run_dir = self.work_dir / sc.recipe / "baseline"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.progress(f"{sc.recipe}/baseline: fault-free run -> {run_dir}")
        t0 = time.monotonic()
        rc = self._launch(
            sc.launch_argv(run_dir, faults=False),
            run_dir.parent / "baseline.log",
            run_dir,
            f"{sc.recipe}/baseline",
        )
        wall = time.monotonic() - t0
        steps = _steps(sc)
        dig, problem = (
            digest_of(run_dir, steps) if rc == 0 else (None, f"baseline launch exited {rc}")
        )
        metrics = RunDir(run_dir).read_metrics()
        step_s = [
            m.get("step_s") for m in metrics if m.get("rank") == 0 and _finite(m.get("step_s"))
        ]
        b = {
            "run_dir": str(run_dir),
            "exit_code": rc,
            "digest": dig,
            "problem": problem,
            "wall_s": round(wall, 1),
            "median_step_s": round(sorted(step_s)[len(step_s) // 2], 4) if step_s else None,
        }
        self.progress(
            f"{sc.recipe}/baseline: "
            + (f"digest {dig[:12]} in {wall:.0f} s" if dig else f"FAILED ({problem})")
        )
        self.baselines[key] = b
        return b

    def run(self, sc: Scenario) -> Result:
        base = self.baseline(sc)
        steps = _steps(sc)
        slug = sc.name.split("/", 1)[1].replace(":", "_").replace(",", "_").replace("=", "")
        run_dir = self.work_dir / sc.recipe / slug
        log = self.work_dir / sc.recipe / f"{slug}.log"
        res = Result(
            scenario=sc.name,
            recipe=sc.recipe,
            kind=sc.kind,
            faults=list(sc.faults),
            run_dir=str(run_dir),
        )
        res.baseline_digest = base.get("digest")
        self.progress(
            f"{sc.name}: launching with {' '.join('--fault ' + f for f in sc.faults)} -> {run_dir}"
        )
        t0 = time.monotonic()
        argv = sc.launch_argv(run_dir)
        while True:
            rc = self._launch(argv, log, run_dir, sc.name)
            res.launches += 1
            res.exit_codes.append(rc)
            if rc in RELAUNCH_CODES and res.launches <= MAX_RELAUNCHES:
                self.progress(
                    f"{sc.name}: launch exited {rc} ({_why(rc)}); relaunching the same command "
                    "to resume"
                )
                continue
            break
        res.wall_s = round(time.monotonic() - t0, 1)
        leftover = _orphans(run_dir)
        res.no_orphans = not leftover
        if leftover:
            res.problems.append(f"processes of the run left behind: {leftover}")
            from ptops.ops.supervisor.procs import teardown

            teardown(None, run_dir, leftover, grace_s=0)
        events = _read_jsonl(run_dir / "events.jsonl")
        metrics = RunDir(run_dir).read_metrics()
        a = analyze(events, metrics, steps, sc.detect)
        for k in (
            "fired",
            "detected_by",
            "detect_s",
            "recover_s",
            "steps_recomputed",
            "restarts",
            "state",
            "final_step",
            "final_loss",
            "ranks_from",
        ):
            setattr(res, k, a[k])
        res.problems += a["cold_restarts"]
        if not res.fired:
            res.problems.append("the fault never fired (no fault_injected event)")
        if rc != 0:
            res.problems.append(f"last launch exited {rc} ({_why(rc)}); see {log}")
        if res.state != "completed":
            res.problems.append(f"run did not complete (state {res.state})")
        if sc.detect and res.fired and res.detected_by is None:
            res.problems.append(f"not detected (expected one of: {', '.join(sc.detect)})")
        lost = []
        if a["missing_steps"]:
            lost.append(f"steps without a metrics record: {_ranges(a['missing_steps'])}")
        if a["nonfinite_steps"]:
            lost.append(f"steps whose final loss is not finite: {_ranges(a['nonfinite_steps'])}")
        ok, why = verify_final(run_dir, steps)
        if not ok:
            lost.append(why)
        res.no_lost_data = not lost
        res.problems += lost
        res.digest, problem = digest_of(run_dir, steps)
        if problem and ok:
            res.problems.append(problem)
        if res.digest is not None and res.baseline_digest is not None:
            res.digest_equal = res.digest == res.baseline_digest
            if not res.digest_equal:
                res.problems.append("final digest differs from the fault-free baseline's")
        elif res.baseline_digest is None:
            res.problems.append(f"no baseline digest ({base.get('problem')})")
        res.passed = not res.problems
        self.progress(f"{sc.name}: {summary_line(res)}")
        return res


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to the launch's process group (the supervisor tears its job down), SIGKILL after 30
    s."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def _steps(sc: Scenario) -> int:
    for s in reversed(sc.sets):
        if s.startswith("train.steps="):
            return int(s.split("=", 1)[1])
    return STEPS


def _why(rc: int) -> str:
    """A launch's exit code in words: ptops' own from its one table, then what else ends a child."""
    from ptops.ops.supervisor import exitcodes

    row = exitcodes.describe(rc)
    if row is not None:
        return row.name
    return {124: "chaos launch timeout", 137: "SIGKILL", -9: "SIGKILL", -15: "SIGTERM"}.get(
        rc, "error"
    )


def _ranges(steps: list[int]) -> str:
    out, start, prev = [], None, None
    for s in steps + [None]:  # type: ignore[list-item]
        if start is None:
            start = prev = s
        elif s is not None and s == prev + 1:
            prev = s
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = s
    return ",".join(out)


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


def summary_line(r: Result) -> str:
    verdict = "PASS" if r.passed else "FAIL"
    dig = {True: "digest = baseline", False: "digest DIFFERS", None: "digest ?"}[r.digest_equal]
    line = (
        f"{verdict}  detect {_fmt_s(r.detect_s)} ({r.detected_by or 'none'}), recover "
        f"{_fmt_s(r.recover_s)}, "
        f"recomputed {r.steps_recomputed}, {dig}, "
        f"{'no lost data' if r.no_lost_data else 'DATA LOST'}, {r.wall_s:.0f} s"
    )
    if r.problems:
        line += "; " + "; ".join(r.problems)
    return line


def run_all(
    scenarios: list[Scenario], work_dir: Path, progress: Callable[[str], None] | None = None, **kw
) -> dict[str, Any]:
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(work_dir, 0o700)
    runner = Runner(work_dir, progress, **kw)
    t0 = time.monotonic()
    results = []
    for i, sc in enumerate(scenarios, 1):
        if progress:
            progress(f"[{i}/{len(scenarios)}] {sc.name}")
        results.append(runner.run(sc))
    report = {
        "work_dir": str(work_dir),
        "passed": all(r.passed for r in results),
        "wall_s": round(time.monotonic() - t0, 1),
        "baselines": {f"{r}": b for (r, _), b in runner.baselines.items()},
        "scenarios": [r.to_dict() for r in results],
    }
    (work_dir / "chaos-report.json").write_text(json.dumps(report, indent=1))
    return report
